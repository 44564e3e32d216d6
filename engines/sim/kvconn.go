package sim

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/nixl"
)

// kvConnector is the KV connector of a prefill or decode worker, the simulated engine's
// counterpart of vLLM's NixlConnector: a nixl agent, named after the engine id, and one
// registered host-memory region with a slot of Config.SlotBytes per KV block.
//
// A slot's bytes are a deterministic function of its block's content key (blockKey: the
// block's sequence hash, or for a prompt's last partial block the hash it would have), so
// a decode worker can check every block it pulled against the prompt it was given.
//
// Prefill side: when a request with do_remote_decode finishes, the engine pins its prompt
// blocks' slots (pin) and the HTTP handler writes their content (publish) before answering
// with kv_transfer_params; the decoder's READ notification or the timeout unpins them.
// Decode side: the engine reserves destination slots and starts a pull goroutine (startPull)
// that connects to the prefill worker, READs the blocks, checks them, notifies the prefill
// worker and reports back to the engine.
//
// Lifecycle: newKVConnector (no side effects) → start (allocates, listens) → run (serves
// notifications until its context ends) → close (safe after a failed start). pin, unpin and
// reserve are called from the engine goroutine, publish from handlers; all methods are
// safe for concurrent use.
type kvConnector struct {
	cfg        Config
	engineID   string
	listen     string
	advertise  string
	slotBytes  int
	slots      int // gpuSlots, then the staging slots (Config.StagingSlots)
	gpuSlots   int
	numGPU     int // block ids from numGPU on name staging slots
	regionName string
	metrics    *Metrics
	backends   []nixl.BackendKind // nil: nixl's default
	peers      *http.Client       // asks holders for their prefixes (peer fetch)

	mem    *nixl.HostMem
	agent  *nixl.Agent
	region *nixl.Region
	host   string // remote_host published in kv_transfer_params
	port   int    // remote_port

	// writeMu serialises content writers (publish) and close, so a second holder of a block
	// whose bytes are being written waits for them instead of answering before they exist.
	writeMu sync.Mutex
	mu      sync.Mutex // guards the slot tables, dials and closed
	keys    []uint64   // content key of each slot, valid where written
	written []bool
	pins    []int32  // held requests pinning each slot
	pinKey  []uint64 // the key those requests need the slot to hold
	busy    []bool   // slots a pull is reading into
	dials   map[string]*sync.Mutex
	closed  bool

	ctx context.Context // the run context, parent of every pull
	wg  sync.WaitGroup  // pull goroutines
}

// kvRegionPrefix starts the name of the registered region; the rest states the layout, which
// a decode worker checks against its own before reading.
const kvRegionPrefix = "kvrelay-sim-kv"

func newKVConnector(cfg Config, engineID, listen, advertiseHost string, m *Metrics) *kvConnector {
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	c := &kvConnector{
		cfg:       cfg,
		engineID:  engineID,
		listen:    listen,
		advertise: advertiseHost,
		slotBytes: cfg.SlotBytes(),
		slots:     cfg.RegionSlots() + cfg.StagingSlots(),
		gpuSlots:  cfg.RegionSlots(),
		numGPU:    cfg.NumGPUBlocks,
		metrics:   m,
		dials:     make(map[string]*sync.Mutex),
		ctx:       context.Background(),
		peers:     &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 16}},
	}
	c.regionName = fmt.Sprintf("%s block_size=%d slot_bytes=%d", kvRegionPrefix, cfg.BlockSize, c.slotBytes)
	return c
}

// newEngineID returns a random engine id in the form of vLLM's (a UUID4 string).
func newEngineID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// start allocates and registers the region and starts the agent listening.
func (c *kvConnector) start() error {
	size := c.slots * c.slotBytes
	mem, err := nixl.AllocHostMem(size)
	if err != nil {
		return fmt.Errorf("allocating %d bytes of KV transfer memory: %w", size, err)
	}
	c.mem = mem
	c.keys = make([]uint64, c.slots)
	c.written = make([]bool, c.slots)
	c.pins = make([]int32, c.slots)
	c.pinKey = make([]uint64, c.slots)
	c.busy = make([]bool, c.slots)
	agent, err := nixl.NewAgent(c.engineID, nixl.Config{ListenAddr: c.listen, Timeout: c.cfg.KVTransferTimeout, Backends: c.backends})
	if err != nil {
		return fmt.Errorf("starting the nixl agent on %s: %w", c.listen, err)
	}
	c.agent = agent
	if c.region, err = agent.RegisterHostMem(mem, nixl.WithRegionName(c.regionName)); err != nil {
		return fmt.Errorf("registering KV transfer memory: %w", err)
	}
	host, port, err := net.SplitHostPort(agent.Addr())
	if err != nil {
		return fmt.Errorf("reading the nixl agent's address %q: %w", agent.Addr(), err)
	}
	c.port, _ = strconv.Atoi(port)
	c.host = host
	if c.advertise != "" {
		c.host = c.advertise
	} else if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		return fmt.Errorf("the KV transfer listener %s is a wildcard address: set the host to advertise in kv_transfer_params", agent.Addr())
	}
	return nil
}

// Addr is the agent's listen address (remote_host:remote_port as bound).
func (c *kvConnector) Addr() string {
	if c.agent == nil {
		return ""
	}
	return c.agent.Addr()
}

// run receives the decoders' READ notifications ("<request id>:<tp size>", as vLLM's
// NixlConnector sends them) and hands the request ids to the engine, until ctx ends.
func (c *kvConnector) run(ctx context.Context, release func(ids []string)) error {
	var ids []string
	for {
		notifs, err := c.agent.WaitNotifs(ctx)
		if err != nil {
			return nil // ctx ended
		}
		ids = ids[:0]
		for _, msgs := range notifs {
			for _, m := range msgs {
				// Python's msg.rsplit(":", 1): the request id may itself hold colons.
				i := strings.LastIndexByte(string(m), ':')
				if i <= 0 {
					c.metrics.kvUnknownNotif()
					continue
				}
				if _, err := strconv.Atoi(string(m[i+1:])); err != nil {
					c.metrics.kvUnknownNotif()
					continue
				}
				ids = append(ids, string(m[:i]))
			}
		}
		if len(ids) > 0 {
			release(ids)
		}
	}
}

// wait waits for the pull goroutines, which end once the run context does.
func (c *kvConnector) wait() { c.wg.Wait() }

// close stops the agent and frees the region. It is safe after a failed start.
func (c *kvConnector) close() error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	var errs []error
	if c.agent != nil {
		errs = append(errs, c.agent.Close())
	}
	c.wg.Wait()
	if c.mem != nil {
		errs = append(errs, c.mem.Free())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("closing the KV connector: %w", err)
	}
	return nil
}

// slot is where block id b lives: b itself, or b mod the GPU slots when the region is
// capped; from numGPU on, b names staging slot b - numGPU, after the GPU slots.
func (c *kvConnector) slot(b int32) int {
	if int(b) >= c.numGPU {
		return c.gpuSlots + int(b) - c.numGPU
	}
	return int(b) % c.gpuSlots
}

// pin reserves the slots of a held request's prompt blocks for the content keys, and fails
// (pinning nothing) when a slot is pinned for other content or being pulled into, which
// can only happen when the region is capped below one slot per block.
func (c *kvConnector) pin(blocks []int32, keys []uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.keys == nil {
		return false
	}
	for i, b := range blocks {
		s := c.slot(b)
		if c.busy[s] || c.pins[s] > 0 && c.pinKey[s] != keys[i] {
			for _, u := range blocks[:i] {
				c.pins[c.slot(u)]--
			}
			return false
		}
		c.pins[s]++
		c.pinKey[s] = keys[i]
	}
	return true
}

// unpin undoes pin.
func (c *kvConnector) unpin(blocks []int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.keys == nil {
		return
	}
	for _, b := range blocks {
		c.pins[c.slot(b)]--
	}
}

// publish writes the content of pinned blocks whose slots do not already hold it. It
// reports false once the connector is closed.
func (c *kvConnector) publish(blocks []int32, keys []uint64) bool {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	c.mu.Lock()
	if c.closed || c.keys == nil {
		c.mu.Unlock()
		return false
	}
	todo := make([]int, 0, len(blocks))
	for i, b := range blocks {
		s := c.slot(b)
		if c.written[s] && c.keys[s] == keys[i] {
			continue
		}
		c.keys[s], c.written[s] = keys[i], true
		todo = append(todo, i)
	}
	c.mu.Unlock()
	buf := c.mem.Bytes()
	for _, i := range todo {
		off := c.slot(blocks[i]) * c.slotBytes
		fillSlot(buf[off:off+c.slotBytes], keys[i])
	}
	return true
}

// reserve picks the destination slots of a pull into local blocks: each block's own slot,
// or when the region is capped and that slot is taken, any free GPU slot (the staging
// slots are the engine's to give). It returns nil when there are not enough free slots.
func (c *kvConnector) reserve(blocks []int32) []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.keys == nil {
		return nil
	}
	dest := make([]int, len(blocks))
	free := func(s int) bool { return !c.busy[s] && c.pins[s] == 0 }
	next := 0
	for i, b := range blocks {
		s := c.slot(b)
		if !free(s) {
			for next < c.gpuSlots && !free(next) {
				next++
			}
			if next == c.gpuSlots {
				for _, d := range dest[:i] {
					c.busy[d] = false
				}
				return nil
			}
			s = next
		}
		c.busy[s], c.written[s] = true, false
		dest[i] = s
	}
	return dest
}

// unreserve ends a pull's hold on its destination slots; verified ones keep their key.
func (c *kvConnector) unreserve(dest []int, keys []uint64, verified bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range dest {
		c.busy[s] = false
		if verified {
			c.keys[s], c.written[s] = keys[i], true
		}
	}
}

// transferError is why a pull failed, with the HTTP status the client gets and the reason
// label of kvrelay_sim_kv_pull_failures_total.
type transferError struct {
	status int
	reason string
	msg    string
}

func (e *transferError) Error() string { return e.msg }

func (e *transferError) apiError() *apiError {
	typ := "InternalServerError"
	switch e.status {
	case http.StatusBadRequest:
		typ = "BadRequestError"
	case http.StatusServiceUnavailable:
		typ = "ServiceUnavailableError"
	}
	return &apiError{status: e.status, typ: typ, message: e.msg}
}

// pullJob is one decode-side pull: the blocks of a request's prompt the local prefix cache
// lacks, from the prefill worker of its kv_transfer_params. The engine fills the inputs and
// reads the outputs after done; the pull goroutine owns it in between.
type pullJob struct {
	r        *Request
	params   *kvTransferParams
	local    []int32  // local blocks to fill
	remote   []int    // the remote blocks they pair with
	keys     []uint64 // content key of each
	modelled time.Duration
	start    time.Time
	done     func(*pullJob)
	parent   context.Context // the pull's context's parent; nil: the connector's

	dest   []int
	cancel context.CancelFunc
	err    *transferError
}

// startPull reserves destination slots and starts the pull; job.done runs when it is over
// (from another goroutine, or at once when no slots are free).
func (c *kvConnector) startPull(job *pullJob) {
	parent := job.parent
	if parent == nil {
		parent = c.ctx
	}
	ctx, cancel := context.WithTimeout(parent, c.cfg.KVTransferTimeout)
	job.cancel = cancel
	if len(job.local) > 0 {
		if job.dest = c.reserve(job.local); job.dest == nil {
			cancel()
			job.err = &transferError{status: http.StatusServiceUnavailable, reason: "slots", msg: "no free KV transfer slots to pull into; retry later"}
			c.metrics.kvPullFailed(job.err.reason)
			job.done(job)
			return
		}
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer cancel()
		err := c.pull(ctx, job)
		if err == nil {
			// The modelled transfer time is a floor: the request waits for it even when the
			// scaled-down real bytes arrived sooner.
			if wait := time.Until(job.start.Add(job.modelled)); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-t.C:
				case <-ctx.Done():
					t.Stop()
					err = c.classify(job, ctx.Err())
				}
			}
		}
		if job.dest != nil {
			c.unreserve(job.dest, job.keys, err == nil)
		}
		if err != nil {
			c.metrics.kvPullFailed(err.reason)
		} else {
			c.metrics.kvPulled(len(job.local), len(job.local)*c.slotBytes, len(job.local)*c.cfg.BlockSize*c.cfg.KVBytesPerToken, job.modelled, time.Since(job.start))
		}
		job.err = err
		job.done(job)
	}()
}

// pull connects to the prefill worker, READs the blocks with vLLM's notification and
// checks what arrived.
func (c *kvConnector) pull(ctx context.Context, job *pullJob) *transferError {
	p := job.params
	addr := net.JoinHostPort(p.RemoteHost, strconv.Itoa(p.RemotePort))
	peer, err := c.connect(ctx, addr)
	if err == nil && peer != p.RemoteEngineID {
		// Maybe a connection to an engine that has since left addr: look again.
		_ = c.agent.InvalidateRemoteMD(peer)
		peer, err = c.connect(ctx, addr)
	}
	if err != nil {
		return c.classify(job, err)
	}
	if peer != p.RemoteEngineID {
		// Agents are named after their engine: another engine listens there now (the
		// prefill worker restarted), and the blocks are gone with the old one.
		return &transferError{status: http.StatusServiceUnavailable, reason: "peer", msg: fmt.Sprintf("remote engine %s is no longer at %s (engine %s is)", p.RemoteEngineID, addr, peer)}
	}
	notif := []byte(p.RemoteRequestID + ":1") // "<remote_request_id>:<tp size>"
	if len(job.local) == 0 {
		// The local prefix cache holds every block: nothing to read, but the prefill worker
		// must still learn it can free them (vLLM sends the notification alone).
		if err := c.agent.GenNotif(ctx, peer, notif); err != nil {
			c.metrics.kvNotifFailed()
		}
		return nil
	}
	md, err := c.agent.RemoteMD(peer)
	if err != nil {
		return c.classify(job, err)
	}
	rd, ok := md.Region(c.regionName)
	if !ok {
		found := "no KV region"
		for _, r := range md.Regions {
			if strings.HasPrefix(r.Name, kvRegionPrefix) {
				found = "a KV region with " + strings.TrimPrefix(r.Name, kvRegionPrefix+" ")
			}
		}
		return &transferError{status: http.StatusInternalServerError, reason: "layout", msg: fmt.Sprintf("remote engine %s at %s has %s; this engine needs %s", peer, addr, found, strings.TrimPrefix(c.regionName, kvRegionPrefix+" "))}
	}
	remoteSlots := int(rd.Len / uint64(c.slotBytes))
	if remoteSlots == 0 {
		return &transferError{status: http.StatusInternalServerError, reason: "layout", msg: fmt.Sprintf("remote engine %s at %s has a KV region of %d bytes, less than one slot", peer, addr, rd.Len)}
	}
	ids := make([]int, len(job.remote))
	for i, b := range job.remote {
		ids[i] = b % remoteSlots
	}
	remote, err := rd.Blocks(uint64(c.slotBytes), ids)
	if err != nil {
		return c.classify(job, err)
	}
	local, err := c.region.Blocks(uint64(c.slotBytes), job.dest)
	if err != nil {
		return c.classify(job, err)
	}
	t := time.Now()
	if err := c.agent.Transfer(ctx, nixl.Read, local, peer, remote, nixl.WithNotif(notif)); err != nil {
		return c.classify(job, err)
	}
	c.metrics.nixlTransfer(time.Since(t), int(local.Len()), len(local.Descs))
	buf := c.mem.Bytes()
	for i, s := range job.dest {
		if !checkSlot(buf[s*c.slotBytes:(s+1)*c.slotBytes], job.keys[i]) {
			c.metrics.kvChecksumError()
			return &transferError{status: http.StatusInternalServerError, reason: "checksum", msg: fmt.Sprintf("KV block %d (remote block %d) pulled from remote engine %s does not hold the prompt's KV: checksum mismatch", i, job.remote[i], peer)}
		}
	}
	return nil
}

// connect returns the agent name at addr, connecting once per address at a time.
func (c *kvConnector) connect(ctx context.Context, addr string) (string, error) {
	c.mu.Lock()
	m := c.dials[addr]
	if m == nil {
		if len(c.dials) > 4096 {
			clear(c.dials)
		}
		m = new(sync.Mutex)
		c.dials[addr] = m
	}
	c.mu.Unlock()
	m.Lock()
	defer m.Unlock()
	return c.agent.Connect(ctx, addr)
}

// classify turns a nixl or network error into what the client and the metrics see: an
// address that does not resolve is the client's mistake (400); a peer that is gone, slow or
// restarted is worth retrying elsewhere (503); anything else is the engine's (500).
func (c *kvConnector) classify(job *pullJob, err error) *transferError {
	p := job.params
	where := fmt.Sprintf("pulling %d KV blocks of request %s from remote engine %s at %s", len(job.local), p.RemoteRequestID, p.RemoteEngineID, net.JoinHostPort(p.RemoteHost, strconv.Itoa(p.RemotePort)))
	var dnsErr *net.DNSError
	var descErr *nixl.DescError
	switch {
	case errors.As(err, &dnsErr) && dnsErr.IsNotFound:
		return &transferError{status: http.StatusBadRequest, reason: "resolve", msg: fmt.Sprintf("kv_transfer_params: remote_host %q does not resolve", p.RemoteHost)}
	case errors.Is(err, nixl.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		c.metrics.nixlFailed()
		return &transferError{status: http.StatusServiceUnavailable, reason: "timeout", msg: where + ": timed out"}
	case errors.Is(err, context.Canceled), errors.Is(err, nixl.ErrClosed):
		return &transferError{status: http.StatusServiceUnavailable, reason: "aborted", msg: where + ": the engine is stopping"}
	case errors.As(err, &descErr), errors.Is(err, nixl.ErrRemote):
		c.metrics.nixlFailed()
		return &transferError{status: http.StatusBadRequest, reason: "rejected", msg: where + ": " + err.Error()}
	case errors.Is(err, nixl.ErrPeerGone), errors.Is(err, nixl.ErrUnknownAgent), errors.Is(err, nixl.ErrStaleMetadata), errors.Is(err, nixl.ErrNameConflict):
		c.metrics.nixlFailed()
		return &transferError{status: http.StatusServiceUnavailable, reason: "peer", msg: where + ": " + err.Error()}
	}
	c.metrics.nixlFailed()
	return &transferError{status: http.StatusInternalServerError, reason: "transfer", msg: where + ": " + err.Error()}
}

// blockKeys appends the content keys of blocks [from, to) of a prompt: a full block's is
// its sequence hash, the last partial block's the hash it would have if it were full
// (blockhash's definition applied to the tokens it has).
func blockKeys(dst []uint64, prompt []uint32, hashes []uint64, blockSize int, keys *blockhash.Keys, from, to int) []uint64 {
	var h blockhash.Hasher
	var extra []byte
	for i := from; i < to; i++ {
		if i < len(hashes) && (i+1)*blockSize <= len(prompt) {
			dst = append(dst, hashes[i])
			continue
		}
		extra = keys.Block(extra[:0], i)
		local := h.Local(prompt[i*blockSize:min(len(prompt), (i+1)*blockSize)], extra)
		if i > 0 {
			local = blockhash.Chain(hashes[i-1], local)
		}
		dst = append(dst, local)
	}
	return dst
}

// fillSlot writes the content of the block with key k: a SplitMix64 stream seeded by k.
func fillSlot(dst []byte, k uint64) {
	s := k
	for len(dst) >= 8 {
		s += 0x9e3779b97f4a7c15
		binary.LittleEndian.PutUint64(dst, mix64(s))
		dst = dst[8:]
	}
	if len(dst) > 0 {
		s += 0x9e3779b97f4a7c15
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], mix64(s))
		copy(dst, tail[:])
	}
}

// checkSlot reports whether src holds exactly the content fillSlot writes for k.
func checkSlot(src []byte, k uint64) bool {
	s := k
	for len(src) >= 8 {
		s += 0x9e3779b97f4a7c15
		if binary.LittleEndian.Uint64(src) != mix64(s) {
			return false
		}
		src = src[8:]
	}
	if len(src) > 0 {
		s += 0x9e3779b97f4a7c15
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], mix64(s))
		return string(src) == string(tail[:len(src)])
	}
	return true
}

func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}
