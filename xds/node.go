package xds

import (
	"fmt"
	"slices"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// NodeModelsKey is the key, in a proxy's node metadata, of the models it routes (a list of
// strings). The control plane then sends it the Worker resources of those models' workers
// only (a worker's base model or one of its adapters named), and those of workers whose
// model is not known; a proxy that names none is sent every worker.
const NodeModelsKey = "kvrelay.serve_models"

// MaxNodeModels bounds the models one proxy names.
const MaxNodeModels = 1024

// SetNodeModels writes models into n's metadata under NodeModelsKey; none removes the key.
func SetNodeModels(n *core.Node, models []string) {
	if len(models) == 0 {
		if n.GetMetadata() != nil {
			delete(n.Metadata.Fields, NodeModelsKey)
		}
		return
	}
	vs := make([]*structpb.Value, len(models))
	for i, m := range models {
		vs[i] = structpb.NewStringValue(m)
	}
	if n.Metadata == nil {
		n.Metadata = &structpb.Struct{}
	}
	if n.Metadata.Fields == nil {
		n.Metadata.Fields = map[string]*structpb.Value{}
	}
	n.Metadata.Fields[NodeModelsKey] = structpb.NewListValue(&structpb.ListValue{Values: vs})
}

// ServesAny reports whether worker w serves one of models, as its base model or one of its
// adapters, or names no model (it serves any): the workers a proxy that routes models
// takes, and that the control plane sends a proxy that names them.
func ServesAny(w *xdsv1.Worker, models []string) bool {
	return w.GetModel() == "" || slices.Contains(models, w.GetModel()) ||
		slices.ContainsFunc(w.GetLoraAdapters(), func(a string) bool { return slices.Contains(models, a) })
}

// CheckNodeModels reports whether NodeModels would take models as a proxy's: at most
// MaxNodeModels names, each non-empty, printable, without spaces, of at most MaxNameLen
// bytes.
func CheckNodeModels(models []string) error {
	n := &core.Node{}
	SetNodeModels(n, models)
	_, err := NodeModels(n)
	return err
}

// NodeModels returns the models n's metadata names under NodeModelsKey, sorted and without
// repeats; nil when it names none. It refuses a value that is not a list of at most
// MaxNodeModels non-empty strings of at most MaxNameLen bytes.
func NodeModels(n *core.Node) ([]string, error) {
	v, ok := n.GetMetadata().GetFields()[NodeModelsKey]
	if !ok {
		return nil, nil
	}
	l, ok := v.GetKind().(*structpb.Value_ListValue)
	if !ok {
		return nil, fmt.Errorf("%w: node metadata %s: not a list", ErrInvalid, NodeModelsKey)
	}
	vs := l.ListValue.GetValues()
	if len(vs) > MaxNodeModels {
		return nil, fmt.Errorf("%w: node metadata %s: %d models, more than %d", ErrInvalid, NodeModelsKey, len(vs), MaxNodeModels)
	}
	models := make([]string, 0, len(vs))
	for i, e := range vs {
		s, ok := e.GetKind().(*structpb.Value_StringValue)
		if !ok {
			return nil, fmt.Errorf("%w: node metadata %s: entry %d is not a string", ErrInvalid, NodeModelsKey, i)
		}
		if err := checkName("node metadata "+NodeModelsKey+" model", s.StringValue, true); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		models = append(models, s.StringValue)
	}
	if len(models) == 0 {
		return nil, nil
	}
	slices.Sort(models)
	return slices.Compact(models), nil
}
