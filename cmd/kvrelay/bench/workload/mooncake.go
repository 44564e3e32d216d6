package workload

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"time"
)

// DefaultTrace is the mooncake workload's default path: the Mooncake conversation trace the
// repository ships (hack/traces/README.md), relative to the repository's root. A path ending
// in .gz is read through gzip.
const DefaultTrace = "hack/traces/mooncake-conversation.jsonl.gz"

var mooncakeParams = []param{
	{"path", DefaultTrace, "the Mooncake JSONL trace (.gz: gzipped)"},
	{"requests", "0", "take the first N lines (0: all)"},
	{"block", "512", "tokens of text per hash_id (a multiple of 16); the partial last block scales alike"},
	{"trace_block", "512", "tokens per hash_id in the trace"},
	{"hints", "false", "send output_length as nvext.agent_hints.osl"},
}

// Stream kinds under the workload seed (newRNG paths).
const (
	streamMooncakeFull = iota + 1
	streamMooncakePartial
	streamPrefixGroups
	streamGroupPrompt
	streamMultiTurn
	streamSystemPrompt
	streamAgentic
	streamPreamble
	streamSubagent
	streamFixed
	streamFixedPrompt
	streamSessionArrivals
	streamChatArrivals
	streamMixedChat
	streamMixedRAG
	streamMixedDoc
	streamMixedPrompt
)

// TraceRecord is one line of a Mooncake trace.
type TraceRecord struct {
	// Timestamp is the arrival time in milliseconds from the start of the trace.
	Timestamp float64 `json:"timestamp"`
	// InputLength and OutputLength are the prompt and completion lengths in tokens.
	InputLength  int `json:"input_length"`
	OutputLength int `json:"output_length"`
	// HashIDs has one id per trace block of the prompt, the last one possibly partial; an id
	// stands for its block and everything before it.
	HashIDs []int64 `json:"hash_ids"`
}

// ReadTrace reads up to limit records (0: all) of a Mooncake JSONL trace, checking that each
// has ceil(input_length / traceBlock) hash ids.
func ReadTrace(r io.Reader, limit, traceBlock int) ([]TraceRecord, error) {
	br := bufio.NewReaderSize(r, 1<<16)
	var recs []TraceRecord
	for line := 1; limit <= 0 || len(recs) < limit; line++ {
		b, err := br.ReadBytes('\n')
		if len(b) > 0 && len(trimSpace(b)) > 0 {
			var rec TraceRecord
			if jerr := json.Unmarshal(b, &rec); jerr != nil {
				return nil, fmt.Errorf("reading trace line %d: %w", line, jerr)
			}
			if verr := rec.validate(traceBlock); verr != nil {
				return nil, fmt.Errorf("reading trace line %d: %w", line, verr)
			}
			recs = append(recs, rec)
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading trace line %d: %w", line, err)
		}
	}
	return recs, nil
}

func (rec *TraceRecord) validate(traceBlock int) error {
	switch {
	case rec.InputLength < 1:
		return fmt.Errorf("%w: input_length %d", ErrSpec, rec.InputLength)
	case rec.OutputLength < 1:
		return fmt.Errorf("%w: output_length %d", ErrSpec, rec.OutputLength)
	case len(rec.HashIDs) != (rec.InputLength+traceBlock-1)/traceBlock:
		return fmt.Errorf("%w: %d hash_ids for input_length %d, want ceil(%d/%d)",
			ErrSpec, len(rec.HashIDs), rec.InputLength, rec.InputLength, traceBlock)
	case rec.Timestamp < 0 || math.IsNaN(rec.Timestamp) || rec.Timestamp > 1e12:
		return fmt.Errorf("%w: timestamp %v", ErrSpec, rec.Timestamp)
	}
	for _, id := range rec.HashIDs {
		if id < 0 {
			return fmt.Errorf("%w: negative hash_id %d", ErrSpec, id)
		}
	}
	return nil
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\r' || b[0] == '\n') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t' || b[len(b)-1] == '\r' || b[len(b)-1] == '\n') {
		b = b[:len(b)-1]
	}
	return b
}

// ScaledLength is the prompt length in tokens that Mooncake text gives a trace input length:
// each full trace block becomes block tokens and the remainder scales by block/traceBlock,
// rounded up so that a partial block never vanishes.
func ScaledLength(inputLength, block, traceBlock int) int {
	full, rem := inputLength/traceBlock, inputLength%traceBlock
	return full*block + (rem*block+traceBlock-1)/traceBlock
}

// MooncakeText turns trace blocks into text. A full block with id h is idWords words spelling
// h followed by block-idWords words drawn from a stream seeded by (seed, h); a partial block is
// the same id words followed by words drawn from a stream seeded by (seed, h, its length). Every
// word is a single space-prefixed token that never merges with its neighbours, so a block's
// tokens do not depend on what precedes it, and a prompt has exactly one token per word.
type MooncakeText struct {
	v            *vocab
	seed         uint64
	block, trace int
	cache        map[int64]string
	scratch      []byte
}

// NewMooncakeText returns the text builder Parse uses for "mooncake" workloads.
func NewMooncakeText(tok Tokenizer, seed uint64, block, traceBlock int) (*MooncakeText, error) {
	v, err := vocabFor(tok)
	if err != nil {
		return nil, err
	}
	return newMooncakeText(v, seed, block, traceBlock), nil
}

func newMooncakeText(v *vocab, seed uint64, block, traceBlock int) *MooncakeText {
	return &MooncakeText{v: v, seed: seed, block: block, trace: traceBlock, cache: make(map[int64]string)}
}

// fullBlock returns the text of the full block id, cached.
func (m *MooncakeText) fullBlock(id int64) string {
	if s, ok := m.cache[id]; ok {
		return s
	}
	b := m.v.appendID(m.scratch[:0], uint64(id), m.block)
	b = m.v.appendWords(b, newRNG(m.seed, streamMooncakeFull, uint64(id)), m.block-idWords)
	m.scratch = b
	s := string(b)
	m.cache[id] = s
	return s
}

// appendPartial appends the n-token partial block id.
func (m *MooncakeText) appendPartial(b []byte, id int64, n int) []byte {
	b = m.v.appendID(b, uint64(id), n)
	return m.v.appendWords(b, newRNG(m.seed, streamMooncakePartial, uint64(id), uint64(n)), n-min(n, idWords))
}

// Prompt returns the prompt text of a trace record: ScaledLength(rec.InputLength) tokens.
func (m *MooncakeText) Prompt(rec *TraceRecord) (string, error) {
	full := rec.InputLength / m.trace
	rem := ScaledLength(rec.InputLength, m.block, m.trace) - full*m.block
	if len(rec.HashIDs) != full+min(rem, 1) {
		return "", fmt.Errorf("%w: %d hash_ids for input_length %d", ErrSpec, len(rec.HashIDs), rec.InputLength)
	}
	size := 0
	for _, id := range rec.HashIDs[:full] {
		if uint64(id) > m.v.maxID() {
			return "", fmt.Errorf("%w: hash_id %d above %d", ErrSpec, id, m.v.maxID())
		}
		size += len(m.fullBlock(id))
	}
	var sb strings.Builder
	sb.Grow(size + (maxWordLen+1)*rem)
	for _, id := range rec.HashIDs[:full] {
		sb.WriteString(m.fullBlock(id))
	}
	if rem > 0 {
		id := rec.HashIDs[full]
		if uint64(id) > m.v.maxID() {
			return "", fmt.Errorf("%w: hash_id %d above %d", ErrSpec, id, m.v.maxID())
		}
		m.scratch = m.appendPartial(m.scratch[:0], id, rem)
		sb.Write(m.scratch)
	}
	return sb.String(), nil
}

func buildMooncake(p *params, seed uint64, v *vocab, _ Tokenizer) (*Workload, error) {
	path := p.string("path")
	limit := p.int("requests", 0, math.MaxInt32)
	block := p.int("block", 16, 1<<16)
	trace := p.int("trace_block", 1, 1<<20)
	hints := p.bool("hints")
	if p.err != nil {
		return nil, p.err
	}
	if block%16 != 0 {
		return nil, fmt.Errorf("parsing workload mooncake: %w: block=%d: want a multiple of 16", ErrSpec, block)
	}
	recs, err := readTraceFile(path, limit, trace)
	if err != nil {
		return nil, err
	}
	m := newMooncakeText(v, seed, block, trace)
	w := &Workload{Open: make([]Request, len(recs))}
	for i := range recs {
		rec := &recs[i]
		prompt, err := m.Prompt(rec)
		if err != nil {
			return nil, fmt.Errorf("%s: request %d: %w", path, i+1, err)
		}
		r := &w.Open[i]
		r.At = time.Duration(math.Round(rec.Timestamp*1e3)) * time.Microsecond
		r.Prompt = prompt
		r.MaxTokens, r.IgnoreEOS = rec.OutputLength, true
		r.Tag = "trace"
		if hints {
			r.OSL = rec.OutputLength
		}
	}
	slices.SortStableFunc(w.Open, func(a, b Request) int { return cmpDuration(a.At, b.At) })
	return w, nil
}

// readTraceFile reads a trace file, gunzipping a .gz one. A missing file's error says how to
// name another: the default path holds only from the repository's root.
func readTraceFile(path string, limit, traceBlock int) ([]TraceRecord, error) {
	f, err := os.Open(path)
	if err != nil {
		hint := "give the trace with --workload mooncake:path=FILE or --workload FILE"
		if path == DefaultTrace {
			hint = "the default trace is relative to the kvrelay repository's root: run from there, or " + hint
		}
		return nil, fmt.Errorf("opening trace: %w (%s)", err, hint)
	}
	defer f.Close()
	var r io.Reader = f
	if strings.HasSuffix(path, ".gz") {
		zr, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		defer zr.Close()
		r = zr
	}
	recs, err := ReadTrace(r, limit, traceBlock)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}

func cmpDuration(a, b time.Duration) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
