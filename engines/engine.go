// Package engines holds what kvrelay knows about each kind of inference engine. This file is
// the seam the control plane uses: an Engine per engine kind says how to read the engine's
// load from its Prometheus metrics, how to find the model it serves, and what its KV event
// publisher looks like by default. The adapters live in engines/vllm (also used for kvrelay's
// simulated engine, which speaks vLLM's names), engines/sglang and engines/trtllm; cmd/ builds
// the Adapters map that picks one per kind.
//
// Other engine-specific hooks (request and response rewriting, P/D parameters) belong to the
// data plane's side of the seam and are not part of this interface.
package engines

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// Kind names an engine kind, as written in a worker's `engine=` setting.
type Kind string

// The engine kinds kvrelay knows.
const (
	KindVLLM   Kind = "vllm"
	KindSGLang Kind = "sglang"
	KindTRTLLM Kind = "trtllm"
	// KindSim is kvrelay's simulated engine (engines/sim), which serves vLLM's API and
	// metric names and is read with the vLLM adapter.
	KindSim Kind = "sim"
)

// Pins reports whether an engine of kind k keeps the blocks of a prompt a request pins
// (Dynamo's nvext.cache_control) past its own eviction order: kvrelay's simulated engine
// does; vLLM has no pin, and SGLang removed its pin call. An index credits a pin only on an
// engine that keeps it.
func (k Kind) Pins() bool { return k == KindSim }

// Kinds lists the known kinds in a stable order (for help texts and errors).
func Kinds() []Kind { return []Kind{KindVLLM, KindSGLang, KindTRTLLM, KindSim} }

// Errors the adapters and Adapters.Get return; test for them with errors.Is.
var (
	// ErrUnknownKind: no adapter is registered for the kind.
	ErrUnknownKind = errors.New("unknown engine kind")
	// ErrNoLoadMetrics: the exposition parsed, but carried none of the engine's load
	// metrics (running, waiting or KV usage): the wrong URL, the wrong engine kind, or an
	// engine started without metrics.
	ErrNoLoadMetrics = errors.New("no load metrics in the exposition")
	// ErrNoModel: the engine's /v1/models listed no model.
	ErrNoModel = errors.New("engine lists no model")
)

// Fields says which of a Load's fields the exposition carried; a field not carried is zero.
type Fields uint8

// The fields of a Load.
const (
	FieldRunning Fields = 1 << iota
	FieldWaiting
	FieldKVUsage
	FieldBlockSize
	FieldCapacityBlocks
	FieldCapacityTokens
)

// Has reports whether every field in want is set.
func (f Fields) Has(want Fields) bool { return f&want == want }

var fieldNames = [...]string{"running", "waiting", "kv_usage", "block_size", "capacity_blocks", "capacity_tokens"}

// String lists the fields set, "running|waiting|kv_usage", or "none".
func (f Fields) String() string {
	var names []string
	for i, n := range fieldNames {
		if f&(1<<i) != 0 {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, "|")
}

// MarshalText writes String's form.
func (f Fields) MarshalText() ([]byte, error) { return []byte(f.String()), nil }

// UnmarshalText reads String's form.
func (f *Fields) UnmarshalText(b []byte) error {
	*f = 0
	if string(b) == "none" || len(b) == 0 {
		return nil
	}
	for _, name := range strings.Split(string(b), "|") {
		i := slices.Index(fieldNames[:], name)
		if i < 0 {
			return fmt.Errorf("parsing load fields: unknown field %q", name)
		}
		*f |= 1 << i
	}
	return nil
}

// Load is what one scrape of an engine's metrics says about its load. Counts add up over the
// engine's data-parallel ranks; KVUsage is their mean.
type Load struct {
	// Running and Waiting are the requests the engine is running and queueing.
	Running int `json:"running"`
	Waiting int `json:"waiting"`
	// KVUsage is the fraction of the KV cache in use, 0 to 1.
	KVUsage float64 `json:"kv_usage"`
	// BlockSize is the engine's KV block (page) size in tokens.
	BlockSize int `json:"block_size,omitempty"`
	// CapacityBlocks is the KV cache's size in blocks; CapacityTokens in tokens.
	CapacityBlocks int `json:"capacity_blocks,omitempty"`
	CapacityTokens int `json:"capacity_tokens,omitempty"`
	// Found says which of the fields above the exposition carried.
	Found Fields `json:"found"`
}

// Model is what an engine's /v1/models says it serves.
type Model struct {
	// ID is the first model listed: the name requests must use.
	ID string `json:"id"`
	// IDs lists every model (a base model and its LoRA adapters, for instance).
	IDs []string `json:"ids"`
	// MaxModelLen is the context length vLLM and SGLang report (0: not reported).
	MaxModelLen int `json:"max_model_len,omitempty"`
}

// KVEventDefaults describe an engine kind's KV event publisher as it comes by default.
type KVEventDefaults struct {
	// Supported is true when the engine publishes KV events over ZMQ in vLLM's wire format
	// (engines/kvevents), which kvrelay ingests.
	Supported bool
	// Port is the PUB socket's conventional port (vLLM's default endpoint is tcp://*:5557).
	Port int
	// EngineBinds is true when the engine binds its PUB socket by default, so the control
	// plane dials it (`kv-events=`); false when it connects out to a subscriber that binds
	// (`kv-events-bind=`).
	EngineBinds bool
	// Topic is the default topic; "" subscribes to everything.
	Topic string
	// Format is the event layout the engine writes by default (engines/kvevents decodes both).
	Format kvevents.Format
	// BigramTokens is true when the engine may send token ids as bigram pairs (SGLang with
	// EAGLE speculative decoding); kvevents unrolls them.
	BigramTokens bool
}

// Engine is the control plane's adapter for one engine kind. Implementations are stateless
// and safe for concurrent use: the registry calls DiscoverModel and HealthPath from its probe
// goroutines, the load view calls ParseLoad from one scrape goroutine per worker.
type Engine interface {
	// Kind is the kind this adapter reads.
	Kind() Kind
	// MetricsPath is where the engine serves its Prometheus metrics, relative to its base
	// URL ("/metrics"); a worker's metrics URL defaults to URL + MetricsPath.
	MetricsPath() string
	// HealthPath is the liveness endpoint relative to the base URL ("/health").
	HealthPath() string
	// ParseLoad reads a Prometheus text exposition. It returns ErrNoLoadMetrics when the
	// exposition has none of the engine's load metrics, and an error when it does not parse.
	ParseLoad(r io.Reader) (Load, error)
	// DiscoverModel asks the engine at baseURL which model it serves.
	DiscoverModel(ctx context.Context, client *http.Client, baseURL string) (Model, error)
	// KVEvents describes the engine's KV event publisher defaults.
	KVEvents() KVEventDefaults
}

// Adapters maps each engine kind to its adapter. cmd/ builds it explicitly; there is no
// registration at init time. Read-only once built, so safe to share between goroutines.
type Adapters map[Kind]Engine

// Get returns the adapter for kind, or an error wrapping ErrUnknownKind.
func (a Adapters) Get(kind Kind) (Engine, error) {
	if e, ok := a[kind]; ok {
		return e, nil
	}
	known := make([]string, 0, len(a))
	for k := range a {
		known = append(known, string(k))
	}
	sort.Strings(known)
	return nil, fmt.Errorf("%w %q (known: %s)", ErrUnknownKind, kind, strings.Join(known, ", "))
}

// MaxExpositionBytes bounds the exposition ParseFamilies reads.
const MaxExpositionBytes = 16 << 20

var bufPool = sync.Pool{New: func() any { return new(expoBufs) }}

type expoBufs struct{ in, kept bytes.Buffer }

// ParseFamilies parses the families named in want out of a Prometheus text exposition. Lines
// that cannot belong to them are dropped before parsing, so an engine's many histograms cost
// a line scan instead of a parse. A line is kept when it mentions a wanted name anywhere, or
// when its metric name is quoted (the UTF-8 form, whose name the scan does not decode): a
// sample always spells out its family's name, so no line of a wanted family is lost. The
// result maps names to families (only wanted ones); it is the caller's to keep.
func ParseFamilies(r io.Reader, want ...string) (map[string]*dto.MetricFamily, error) {
	bufs := bufPool.Get().(*expoBufs)
	defer func() {
		bufs.in.Reset()
		bufs.kept.Reset()
		bufPool.Put(bufs)
	}()
	n, err := bufs.in.ReadFrom(io.LimitReader(r, MaxExpositionBytes+1))
	if err != nil {
		return nil, fmt.Errorf("reading metrics exposition: %w", err)
	}
	if n > MaxExpositionBytes {
		return nil, fmt.Errorf("reading metrics exposition: larger than %d bytes", MaxExpositionBytes)
	}
	data := bufs.in.Bytes()
	for len(data) > 0 {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i+1], data[i+1:]
		} else {
			data = nil
		}
		if keepLine(line, want) {
			bufs.kept.Write(line)
			if line[len(line)-1] != '\n' {
				bufs.kept.WriteByte('\n')
			}
		}
	}
	fams := make(map[string]*dto.MetricFamily, len(want))
	if bufs.kept.Len() == 0 {
		return fams, nil
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	all, err := p.TextToMetricFamilies(&bufs.kept)
	if err != nil {
		return nil, fmt.Errorf("parsing metrics exposition: %w", err)
	}
	for _, w := range want {
		if f, ok := all[w]; ok {
			fams[w] = f
		}
	}
	return fams, nil
}

// keepLine reports whether a line of the text format may belong to a wanted family.
func keepLine(line []byte, want []string) bool {
	for _, w := range want {
		if bytes.Contains(line, []byte(w)) {
			return true
		}
	}
	// The metric name may be quoted, in whole or in part, and then the scan above cannot
	// see it: keep such lines. The name is what precedes the labels or the value; in a
	// HELP or TYPE comment, the third word.
	line = bytes.TrimLeft(line, " \t")
	if len(line) > 0 && line[0] == '#' {
		f := bytes.Fields(line[1:])
		return len(f) >= 2 && (string(f[0]) == "HELP" || string(f[0]) == "TYPE") &&
			bytes.IndexByte(f[1], '"') >= 0
	}
	if len(line) > 0 && line[0] == '{' {
		return true
	}
	end := bytes.IndexAny(line, "{ \t")
	if end < 0 {
		end = len(line)
	}
	return bytes.IndexByte(line[:end], '"') >= 0
}

// Value is a sample's value for gauges, counters and untyped samples; false for histograms,
// summaries and non-finite values.
func Value(m *dto.Metric) (float64, bool) {
	var v float64
	switch {
	case m.GetGauge() != nil:
		v = m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		v = m.GetUntyped().GetValue()
	case m.GetCounter() != nil:
		v = m.GetCounter().GetValue()
	default:
		return 0, false
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return v, true
}

// Label returns the value of a sample's label, "" when it has none of that name.
func Label(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

// Match selects samples of a family; nil matches every sample.
type Match func(m *dto.Metric) bool

// LabelIs matches samples whose label name has value v.
func LabelIs(name, v string) Match {
	return func(m *dto.Metric) bool { return Label(m, name) == v }
}

// Sum adds up the values of the family's matching samples; n is how many there were.
func Sum(f *dto.MetricFamily, match Match) (sum float64, n int) {
	for _, m := range f.GetMetric() {
		if match != nil && !match(m) {
			continue
		}
		if v, ok := Value(m); ok {
			sum += v
			n++
		}
	}
	return sum, n
}

// Mean averages the values of the family's matching samples; false when there are none.
func Mean(f *dto.MetricFamily, match Match) (float64, bool) {
	sum, n := Sum(f, match)
	if n == 0 {
		return 0, false
	}
	return sum / float64(n), true
}

// Count turns a metric value into a count: rounded, negative values to 0, huge ones capped.
func Count(v float64) int {
	switch {
	case math.IsNaN(v) || v <= 0:
		return 0
	case v >= math.MaxInt32:
		return math.MaxInt32
	}
	return int(math.Round(v))
}

// Fraction clamps a usage value to [0, 1].
func Fraction(v float64) float64 {
	switch {
	case math.IsNaN(v) || v <= 0:
		return 0
	case v >= 1:
		return 1
	}
	return v
}

// MaxModelsBytes bounds the /v1/models answer DiscoverOpenAIModel reads.
const MaxModelsBytes = 1 << 20

// DiscoverOpenAIModel asks an OpenAI-compatible server which models it serves (GET
// baseURL/v1/models), as vLLM, SGLang and trtllm-serve all answer it.
func DiscoverOpenAIModel(ctx context.Context, client *http.Client, baseURL string) (Model, error) {
	if client == nil {
		client = http.DefaultClient
	}
	url := strings.TrimRight(baseURL, "/") + "/v1/models"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Model{}, fmt.Errorf("discovering model: %w", err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return Model{}, fmt.Errorf("discovering model: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, MaxModelsBytes))
	if err != nil {
		return Model{}, fmt.Errorf("discovering model: reading %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return Model{}, fmt.Errorf("discovering model: GET %s: status %d", url, resp.StatusCode)
	}
	return ParseModels(body)
}

// ParseModels reads an OpenAI /v1/models answer.
func ParseModels(body []byte) (Model, error) {
	var list struct {
		Data []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return Model{}, fmt.Errorf("parsing model list: %w", err)
	}
	var m Model
	for _, d := range list.Data {
		if d.ID == "" {
			continue
		}
		if m.ID == "" {
			m.ID, m.MaxModelLen = d.ID, max(d.MaxModelLen, 0)
		}
		m.IDs = append(m.IDs, d.ID)
	}
	if m.ID == "" {
		return Model{}, ErrNoModel
	}
	return m, nil
}
