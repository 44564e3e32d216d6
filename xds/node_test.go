package xds_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrelay/kvrelay/xds"
)

func TestNodeModels(t *testing.T) {
	n := &core.Node{Id: "p"}
	if got, err := xds.NodeModels(n); got != nil || err != nil {
		t.Fatalf("no metadata: %v, %v", got, err)
	}
	xds.SetNodeModels(n, []string{"b", "a", "b"})
	got, err := xds.NodeModels(n)
	if err != nil || !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("round trip: %v, %v; want [a b]", got, err)
	}
	// Through the wire, as the control plane reads it.
	raw, err := proto.Marshal(n)
	if err != nil {
		t.Fatal(err)
	}
	var back core.Node
	if err := proto.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if got, err := xds.NodeModels(&back); err != nil || !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("through the wire: %v, %v", got, err)
	}
	xds.SetNodeModels(n, nil)
	if got, err := xds.NodeModels(n); got != nil || err != nil {
		t.Fatalf("after clearing: %v, %v", got, err)
	}

	many := make([]any, xds.MaxNodeModels+1)
	for i := range many {
		many[i] = "m" + strings.Repeat("x", i%7)
	}
	for name, v := range map[string]*structpb.Value{
		"a string":           structpb.NewStringValue("a"),
		"a number in a list": mustValue(t, []any{"a", 3.0}),
		"an empty model":     mustValue(t, []any{"a", ""}),
		"a model with space": mustValue(t, []any{"a b"}),
		"a long model":       mustValue(t, []any{strings.Repeat("m", xds.MaxNameLen+1)}),
		"too many models":    mustValue(t, many),
	} {
		n := &core.Node{Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{xds.NodeModelsKey: v}}}
		if got, err := xds.NodeModels(n); !errors.Is(err, xds.ErrInvalid) {
			t.Errorf("%s: %v, %v; want an invalid resource error", name, got, err)
		}
	}
	empty := &core.Node{Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{xds.NodeModelsKey: mustValue(t, []any{})}}}
	if got, err := xds.NodeModels(empty); got != nil || err != nil {
		t.Fatalf("an empty list: %v, %v; want none", got, err)
	}
}

func mustValue(t *testing.T, v any) *structpb.Value {
	t.Helper()
	sv, err := structpb.NewValue(v)
	if err != nil {
		t.Fatal(err)
	}
	return sv
}

// FuzzNodeModels reads any node a proxy may send: an error or models within the bounds,
// sorted and distinct, never a panic.
func FuzzNodeModels(f *testing.F) {
	for _, models := range [][]string{nil, {"a"}, {"Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "a-lora"}} {
		n := &core.Node{Id: "p"}
		xds.SetNodeModels(n, models)
		raw, _ := proto.Marshal(n)
		f.Add(raw)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		var n core.Node
		if proto.Unmarshal(raw, &n) != nil {
			return
		}
		got, err := xds.NodeModels(&n)
		if err != nil {
			return
		}
		if len(got) > xds.MaxNodeModels || !slices.IsSorted(got) || len(slices.Compact(slices.Clone(got))) != len(got) {
			t.Fatalf("models %q", got)
		}
		for _, m := range got {
			if m == "" || len(m) > xds.MaxNameLen {
				t.Fatalf("model %q", m)
			}
		}
	})
}
