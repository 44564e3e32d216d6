package sim

import (
	"context"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// FinishReason says why a request stopped producing tokens.
type FinishReason string

// The reasons a request finishes, as the OpenAI API names them (plus aborted, which no client
// sees because it is the client that left).
const (
	FinishStop    FinishReason = "stop"
	FinishLength  FinishReason = "length"
	FinishAborted FinishReason = "abort"
	// FinishError ends a request whose prompt KV could not be pulled from the prefill
	// worker of its kv_transfer_params; the client gets an error status.
	FinishError FinishReason = "error"
)

// Params are what a client asked of one generation.
type Params struct {
	// MaxTokens caps the output; 0 means up to the model length.
	MaxTokens int
	// MinTokens is the output length before which the natural end of text is ignored.
	MinTokens int
	// IgnoreEOS makes the request generate exactly MaxTokens tokens.
	IgnoreEOS bool
	// Priority orders the waiting queue under the priority policy; lower runs first (vLLM's
	// convention).
	Priority int
	// PinTTL, when positive, pins the request's prompt blocks for that long (Dynamo's
	// nvext.cache_control {"type": "ephemeral", "ttl": "5m"}): evicted last, renewed on
	// every hit, within Config.MaxPinnedFraction.
	PinTTL time.Duration
	// EphemeralOutput marks the blocks holding only generated tokens as ephemeral: a chat
	// client re-renders its history rather than sending the output back token for token
	// (a harmony client drops the analysis channel), so nobody reads them again. EvictWORM
	// evicts them first and never offloads them.
	EphemeralOutput bool
	// LimitLoad caps at MaxLoadTokens the prompt tokens brought back from host memory or
	// disk beyond the prefix cached in GPU memory (vLLM's kv_transfer_params
	// max_load_tokens): the rest is computed. MaxLoadTokens 0 computes every block not on
	// the GPU.
	LimitLoad     bool
	MaxLoadTokens int
}

// Request is one generation submitted to an Engine. The engine's scheduler goroutine owns the
// unexported scheduling state; a client reads the output through Wait and Output, which are
// safe to call from any goroutine.
type Request struct {
	ID      string
	Params  Params
	arrival time.Time
	// scheduledAt is when the request was first scheduled (left the waiting queue).
	scheduledAt time.Time

	// Scheduler state, owned by the engine goroutine.
	seqNo       uint64
	tokens      []uint32 // prompt followed by the output so far
	promptLen   int
	maxTokens   int // the output cap: max_tokens, or what the model length leaves
	maxOut      int // where the output ends: maxTokens, or earlier at the natural end of text
	keys        blockhash.Keys
	hashes      []uint64 // sequence hashes of every full block of tokens
	blocks      []int32
	numComputed int
	numStored   int // leading blocks registered in the prefix cache or taken from it
	scheduled   bool
	admitted    bool
	state       reqState
	lastTokenAt time.Time
	heapIndex   int

	// KV transfer, set by the server before Submit: kvDecode keeps the blocks for a remote
	// decode when the request finishes (prefill leg), kvPull pulls the prompt's blocks
	// from a prefill worker instead of computing them (decode leg).
	kvDecode bool
	kvPull   *kvTransferParams
	// Engine-owned: the prompt's KV came from a pull (its last token computes as a
	// decode); cancels the pull.
	pulled     bool
	pullCancel context.CancelFunc
	// peerHolder is the base URL of the worker to fetch the prompt's prefix from (peer
	// fetch), asked when the request is admitted; peerFetch marks a pull as one, whose
	// failure falls back to computing the prompt; peerPartial, one that asks for only the
	// leading blocks there was room for.
	peerHolder  string
	peerFetch   bool
	peerPartial bool
	// kvRequestID and prefillOf name the request across the legs of vLLM's p2p form: a
	// prefill leg's hold (kvDecode), freed when a decoder's export names it; the prefill leg
	// whose blocks a decode leg pulls from its prefiller (peerHolder), named in the export
	// it asks for.
	kvRequestID, prefillOf string

	// Output, shared with the client under mu.
	mu       sync.Mutex
	notify   chan struct{}
	out      []uint32
	cached   int
	reason   FinishReason
	done     bool
	firstTok time.Time
	kvHeld   *heldKV        // blocks kept for a remote decode, when the request finished so
	failure  *transferError // why a FinishError request failed
}

// heldKV is what a finished prefill-leg request keeps for its remote decode: all its
// blocks, and the content keys of the prompt's blocks (the first len(keys) blocks).
type heldKV struct {
	blocks []int32
	keys   []uint64
}

type reqState uint8

const (
	stateNew reqState = iota
	stateWaiting
	stateRunning
	stateLoading // blocks allocated, prompt KV being pulled from a prefill worker
	stateReady   // prompt KV pulled, waiting to be scheduled with its blocks
	stateFinished
)

// PromptTokens returns the number of prompt tokens.
func (r *Request) PromptTokens() int { return r.promptLen }

// Wait returns a channel that receives a value whenever new output is available or the
// request finished. Several outputs may be coalesced into one notification.
func (r *Request) Wait() <-chan struct{} { return r.notify }

// Output appends the output tokens from index from onwards to dst and reports whether the
// request has finished, why, and how many prompt tokens it found in the prefix cache.
func (r *Request) Output(dst []uint32, from int) (toks []uint32, done bool, reason FinishReason, cached int) {
	r.mu.Lock()
	if from < len(r.out) {
		dst = append(dst, r.out[from:]...)
	}
	done, reason, cached = r.done, r.reason, r.cached
	r.mu.Unlock()
	return dst, done, reason, cached
}

// transfer returns, once the request has finished, the blocks it keeps for a remote decode
// and why it failed, if it did.
func (r *Request) transfer() (*heldKV, *transferError) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.kvHeld, r.failure
}

func (r *Request) signal() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// waitQueue holds requests waiting to be scheduled. Under FCFS it is a deque in arrival order
// (preempted requests return to the front); under the priority policy it is a binary heap on
// (priority, arrival).
type waitQueue struct {
	byPriority bool
	items      []*Request
	start      int // FCFS: index of the first live item
}

func (q *waitQueue) len() int { return len(q.items) - q.start }

func (q *waitQueue) less(a, b *Request) bool {
	if a.Params.Priority != b.Params.Priority {
		return a.Params.Priority < b.Params.Priority
	}
	return a.seqNo < b.seqNo
}

func (q *waitQueue) push(r *Request) {
	if !q.byPriority {
		q.items = append(q.items, r)
		return
	}
	r.heapIndex = len(q.items)
	q.items = append(q.items, r)
	q.up(r.heapIndex)
}

// pushFront returns a preempted request to the head of an FCFS queue; under the priority
// policy its place follows from its priority and arrival.
func (q *waitQueue) pushFront(r *Request) {
	if q.byPriority {
		q.push(r)
		return
	}
	if q.start > 0 {
		q.start--
		q.items[q.start] = r
		return
	}
	q.items = append(q.items, nil)
	copy(q.items[1:], q.items)
	q.items[0] = r
}

func (q *waitQueue) peek() *Request {
	if q.len() == 0 {
		return nil
	}
	return q.items[q.start]
}

func (q *waitQueue) pop() *Request {
	if !q.byPriority {
		r := q.items[q.start]
		q.items[q.start] = nil
		q.start++
		if q.start == len(q.items) {
			q.items, q.start = q.items[:0], 0
		} else if q.start > 1024 && q.start*2 > len(q.items) {
			n := copy(q.items, q.items[q.start:])
			clear(q.items[n:])
			q.items, q.start = q.items[:n], 0
		}
		return r
	}
	return q.removeAt(0)
}

// remove takes r out of the queue wherever it is and reports whether it was there.
func (q *waitQueue) remove(r *Request) bool {
	if q.byPriority {
		if r.heapIndex < 0 || r.heapIndex >= len(q.items) || q.items[r.heapIndex] != r {
			return false
		}
		q.removeAt(r.heapIndex)
		return true
	}
	for i := q.start; i < len(q.items); i++ {
		if q.items[i] == r {
			copy(q.items[i:], q.items[i+1:])
			q.items[len(q.items)-1] = nil
			q.items = q.items[:len(q.items)-1]
			if q.start == len(q.items) {
				q.items, q.start = q.items[:0], 0
			}
			return true
		}
	}
	return false
}

func (q *waitQueue) removeAt(i int) *Request {
	r := q.items[i]
	last := len(q.items) - 1
	q.swap(i, last)
	q.items[last] = nil
	q.items = q.items[:last]
	if i < last {
		q.down(i)
		q.up(i)
	}
	r.heapIndex = -1
	return r
}

func (q *waitQueue) swap(i, j int) {
	q.items[i], q.items[j] = q.items[j], q.items[i]
	q.items[i].heapIndex = i
	q.items[j].heapIndex = j
}

func (q *waitQueue) up(i int) {
	for i > 0 {
		parent := (i - 1) / 2
		if !q.less(q.items[i], q.items[parent]) {
			return
		}
		q.swap(i, parent)
		i = parent
	}
}

func (q *waitQueue) down(i int) {
	n := len(q.items)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && q.less(q.items[r], q.items[l]) {
			m = r
		}
		if !q.less(q.items[m], q.items[i]) {
			return
		}
		q.swap(i, m)
		i = m
	}
}
