package nixl

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

const (
	readBufSize = 64 << 10
	// abandonGrace is how long giving up on a READ waits for the connection reader to
	// finish the data frame it is writing into the transfer's memory before the connection
	// is torn down instead (a peer stalled mid-frame).
	abandonGrace = 250 * time.Millisecond
)

// conn is the persistent TCP connection between this agent and one peer. Either side may
// start requests on it; they are multiplexed by request id. One goroutine (readLoop) reads
// every frame and writes data straight into registered memory; writers serialise whole
// frames under wmu and send them with vectored writes straight from registered memory.
// The reader never writes: replies it owes go out from short-lived goroutines, so two
// agents' readers can never block on each other's full socket buffers.
type conn struct {
	a    *Agent
	nc   net.Conn
	br   *bufio.Reader
	peer string
	inst uint64 // the peer's instance, from its HELLO

	wmu sync.Mutex // held for the duration of one vectored write

	mu       sync.Mutex
	dead     bool
	err      error // why it died; wraps ErrPeerGone
	nextID   uint64
	calls    map[uint64]*call    // requests this side started
	outReads map[uint64]*outRead // peer's READs being answered

	inWrites map[uint64]*inWrite // peer's WRITEs being received; reader-owned
}

// call is a request this side started: READ, WRITE or metadata.
type call struct {
	typ  frameType
	id   uint64
	done chan struct{}
	err  error // set before done closes

	finished bool // under conn.mu

	// READ destination, filled by the reader in order.
	fill      sync.Mutex // held by the reader while it writes into segs
	segs      [][]byte
	cur       cursor
	total     uint64
	got       uint64
	abandoned bool // under fill: the reader must not touch segs any more

	resp []byte // MD_RESP body
}

// outRead is a peer's READ this side is answering.
type outRead struct {
	canceled atomic.Bool
}

// inWrite is a peer's WRITE this side is receiving.
type inWrite struct {
	segs     [][]byte
	regs     []*Region
	cur      cursor
	total    uint64
	got      uint64
	notif    []byte
	rejected bool // validation failed: discard the data
}

// cursor walks a list of segments in order.
type cursor struct {
	idx int
	pos int
}

func newConn(a *Agent, nc net.Conn, br *bufio.Reader, peer string, inst uint64) *conn {
	return &conn{
		a:        a,
		nc:       nc,
		br:       br,
		peer:     peer,
		inst:     inst,
		calls:    make(map[uint64]*call),
		outReads: make(map[uint64]*outRead),
		inWrites: make(map[uint64]*inWrite),
	}
}

func (c *conn) isDead() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dead
}

// fail kills the connection once: every pending call ends with an error wrapping
// ErrPeerGone and cause. It is safe from any goroutine.
func (c *conn) fail(cause error) {
	c.mu.Lock()
	if c.dead {
		c.mu.Unlock()
		return
	}
	c.dead = true
	c.err = fmt.Errorf("connection to %q: %w: %w", c.peer, ErrPeerGone, cause)
	calls := make([]*call, 0, len(c.calls))
	for _, cl := range c.calls {
		cl.finished = true
		calls = append(calls, cl)
	}
	clear(c.calls)
	c.mu.Unlock()

	c.nc.Close() // unblocks the reader, so fill below is released promptly
	c.a.dropConn(c)
	for _, cl := range calls {
		cl.fill.Lock()
		cl.abandoned = true
		cl.fill.Unlock()
		cl.err = c.err
		close(cl.done)
	}
}

// register adds a call and assigns its id.
func (c *conn) register(cl *call) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return c.err
	}
	c.nextID++
	cl.id = c.nextID
	cl.done = make(chan struct{})
	c.calls[cl.id] = cl
	return nil
}

// lookup returns the live call with id, or nil.
func (c *conn) lookup(id uint64) *call {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[id]
}

// finish ends a call with err unless it already ended.
func (c *conn) finish(cl *call, err error) {
	c.mu.Lock()
	if cl.finished {
		c.mu.Unlock()
		return
	}
	cl.finished = true
	delete(c.calls, cl.id)
	c.mu.Unlock()
	cl.err = err
	close(cl.done)
}

// abandon gives up on a call (its context ended). It returns once the reader no longer
// writes into the call's memory. It reports false when the call had already finished, in
// which case cl.err holds its result.
func (c *conn) abandon(cl *call) bool {
	c.mu.Lock()
	if cl.finished {
		c.mu.Unlock()
		<-cl.done
		return false
	}
	cl.finished = true
	delete(c.calls, cl.id)
	c.mu.Unlock()
	if !cl.fill.TryLock() {
		t := time.AfterFunc(abandonGrace, func() {
			c.fail(fmt.Errorf("peer stalled inside a data frame of abandoned request %d", cl.id))
		})
		cl.fill.Lock()
		t.Stop()
	}
	cl.abandoned = true
	cl.fill.Unlock()
	return true
}

// deadline is when a write on behalf of ctx must have finished.
func (c *conn) deadline(ctx context.Context) time.Time {
	d := time.Now().Add(c.a.cfg.Timeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(d) {
		return dl
	}
	return d
}

// send writes bufs (one or more complete frames) as one vectored write. A failed or
// partial write kills the connection, since the frame stream is then broken.
func (c *conn) send(deadline time.Time, bufs net.Buffers) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	dead, err := c.dead, c.err
	c.mu.Unlock()
	if dead {
		return err
	}
	c.nc.SetWriteDeadline(deadline)
	if _, err := bufs.WriteTo(c.nc); err != nil {
		c.fail(fmt.Errorf("writing: %w", err))
		c.mu.Lock()
		err = c.err
		c.mu.Unlock()
		return err
	}
	return nil
}

// sendFrame sends one frame with a small body.
func (c *conn) sendFrame(deadline time.Time, t frameType, id uint64, body []byte) error {
	h := make([]byte, hdrSize)
	putHeader(h, frameHeader{length: uint32(len(body)), typ: t, id: id})
	return c.send(deadline, net.Buffers{h, body})
}

// sendAsync sends a reply frame from a new goroutine (the reader must not block on
// writes); errors kill the connection, which is all a lost reply can do.
func (c *conn) sendAsync(t frameType, id uint64, body []byte) {
	go c.sendFrame(time.Now().Add(c.a.cfg.Timeout), t, id, body)
}

// dataHeader builds the header and offset prefix of a data frame of n payload bytes.
func dataHeader(t frameType, id uint64, off, n uint64, last bool) []byte {
	b := make([]byte, hdrSize+8)
	var flags uint8
	if last {
		flags = flagLast
	}
	putHeader(b, frameHeader{length: uint32(8 + n), typ: t, flags: flags, id: id})
	binary.LittleEndian.PutUint64(b[hdrSize:], off)
	return b
}

// gather appends to bufs the next n bytes of segs from cur.
func gather(bufs net.Buffers, segs [][]byte, cur *cursor, n uint64) net.Buffers {
	for n > 0 {
		s := segs[cur.idx][cur.pos:]
		k := min(uint64(len(s)), n)
		bufs = append(bufs, s[:k])
		n -= k
		cur.pos += int(k)
		if cur.pos == len(segs[cur.idx]) {
			cur.idx++
			cur.pos = 0
		}
	}
	return bufs
}

// readInto reads the next n bytes of the stream into segs from cur.
func readInto(r io.Reader, segs [][]byte, cur *cursor, n uint64) error {
	for n > 0 {
		s := segs[cur.idx][cur.pos:]
		k := min(uint64(len(s)), n)
		if _, err := io.ReadFull(r, s[:k]); err != nil {
			return err
		}
		n -= k
		cur.pos += int(k)
		if cur.pos == len(segs[cur.idx]) {
			cur.idx++
			cur.pos = 0
		}
	}
	return nil
}

// read runs a READ: the peer's segs are copied into dst (same total length).
func (c *conn) read(ctx context.Context, segs []wireSeg, dst [][]byte, total uint64) error {
	cl := &call{typ: frReadReq, segs: dst, total: total}
	if err := c.register(cl); err != nil {
		return err
	}
	if err := c.sendFrame(c.deadline(ctx), frReadReq, cl.id, encodeReadReq(segs)); err != nil {
		c.finish(cl, err)
		<-cl.done
		return cl.err
	}
	select {
	case <-cl.done:
		return cl.err
	case <-ctx.Done():
		if !c.abandon(cl) {
			return cl.err
		}
		go c.sendFrame(time.Now().Add(c.a.cfg.Timeout), frCancel, cl.id, nil)
		return context.Cause(ctx)
	}
}

// write runs a WRITE: src (same total length) is copied into the peer's segs and notif is
// delivered to the peer once the data has landed.
func (c *conn) write(ctx context.Context, segs []wireSeg, src [][]byte, total uint64, notif []byte) error {
	cl := &call{typ: frWriteReq}
	if err := c.register(cl); err != nil {
		return err
	}
	req := encodeWriteReq(notif, segs)
	rh := make([]byte, hdrSize)
	putHeader(rh, frameHeader{length: uint32(len(req)), typ: frWriteReq, id: cl.id})
	chunk := uint64(c.a.cfg.ChunkSize)
	var cur cursor
	bufs := make(net.Buffers, 0, 8)
	for off := uint64(0); off < total; {
		n := min(chunk, total-off)
		bufs = bufs[:0]
		if off == 0 {
			bufs = append(bufs, rh, req) // the request and the first chunk in one write
		}
		bufs = append(bufs, dataHeader(frWData, cl.id, off, n, off+n == total))
		bufs = gather(bufs, src, &cur, n)
		if err := c.send(c.deadline(ctx), bufs); err != nil {
			c.finish(cl, err)
			<-cl.done
			return cl.err
		}
		off += n
		if off == total {
			break
		}
		select {
		case <-cl.done: // rejected by the peer: stop sending
			c.sendFrame(c.deadline(ctx), frCancel, cl.id, nil)
			return cl.err
		case <-ctx.Done():
			if !c.abandon(cl) {
				return cl.err
			}
			c.sendFrame(time.Now().Add(c.a.cfg.Timeout), frCancel, cl.id, nil)
			return context.Cause(ctx)
		default:
		}
	}
	select {
	case <-cl.done:
		return cl.err
	case <-ctx.Done():
		if !c.abandon(cl) {
			return cl.err
		}
		return context.Cause(ctx)
	}
}

// fetchMD asks the peer for its metadata.
func (c *conn) fetchMD(ctx context.Context) ([]byte, error) {
	cl := &call{typ: frMDReq}
	if err := c.register(cl); err != nil {
		return nil, err
	}
	if err := c.sendFrame(c.deadline(ctx), frMDReq, cl.id, nil); err != nil {
		c.finish(cl, err)
		<-cl.done
		return nil, cl.err
	}
	select {
	case <-cl.done:
		return cl.resp, cl.err
	case <-ctx.Done():
		if !c.abandon(cl) {
			return cl.resp, cl.err
		}
		return nil, context.Cause(ctx)
	}
}

// notify sends a notification frame; it does not wait for the peer.
func (c *conn) notify(ctx context.Context, msg []byte) error {
	return c.sendFrame(c.deadline(ctx), frNotif, 0, msg)
}

// readLoop reads frames until the connection fails, then cleans up what the reader owns.
func (c *conn) readLoop() {
	err := c.readFrames()
	c.fail(err)
	for id, w := range c.inWrites {
		for _, r := range w.regs {
			r.release()
		}
		delete(c.inWrites, id)
	}
}

// readFrames is the reader's loop; it returns why the connection must close.
func (c *conn) readFrames() error {
	var hb [hdrSize + 8]byte
	for {
		if _, err := io.ReadFull(c.br, hb[:hdrSize]); err != nil {
			return fmt.Errorf("reading: %w", err)
		}
		h, err := parseHeader(hb[:hdrSize])
		if err != nil {
			return err
		}
		// A frame that has started must finish arriving within the timeout.
		stall := int(h.length) > c.br.Buffered()
		if stall {
			c.nc.SetReadDeadline(time.Now().Add(c.a.cfg.Timeout))
		}
		if err := c.handle(h, hb[hdrSize:]); err != nil {
			return err
		}
		if stall {
			c.nc.SetReadDeadline(time.Time{})
		}
	}
}

// body reads a whole (bounded) frame body.
func (c *conn) body(h frameHeader) ([]byte, error) {
	b := make([]byte, h.length)
	if _, err := io.ReadFull(c.br, b); err != nil {
		return nil, fmt.Errorf("reading %s body: %w", h.typ, err)
	}
	return b, nil
}

func (c *conn) discard(n uint64) error {
	_, err := c.br.Discard(int(n))
	return err
}

// handle processes one frame whose header has been read; scratch holds 8 bytes.
func (c *conn) handle(h frameHeader, scratch []byte) error {
	switch h.typ {
	case frHello:
		return fmt.Errorf("HELLO after handshake: %w", ErrProtocol)

	case frMDReq:
		go func() {
			md, err := c.a.GetLocalMD()
			if err != nil {
				c.sendFrame(time.Now().Add(c.a.cfg.Timeout), frError, h.id, encodeError(err))
				return
			}
			c.sendFrame(time.Now().Add(c.a.cfg.Timeout), frMDResp, h.id, md)
		}()
		return nil

	case frMDResp, frAck, frError:
		b, err := c.body(h)
		if err != nil {
			return err
		}
		cl := c.lookup(h.id)
		if cl == nil {
			return nil // abandoned
		}
		switch {
		case h.typ == frError:
			c.finish(cl, decodeError(c.peer, b))
		case h.typ == frMDResp && cl.typ == frMDReq:
			cl.resp = b
			c.finish(cl, nil)
		case h.typ == frAck && cl.typ == frWriteReq:
			c.finish(cl, nil)
		default:
			return fmt.Errorf("%s answers a %s request: %w", h.typ, cl.typ, ErrProtocol)
		}
		return nil

	case frNotif:
		b, err := c.body(h)
		if err != nil {
			return err
		}
		c.a.deliver(c.peer, b)
		return nil

	case frReadReq:
		b, err := c.body(h)
		if err != nil {
			return err
		}
		segs, total, err := decodeReadReq(b)
		if err != nil {
			return err
		}
		c.mu.Lock()
		_, dup := c.outReads[h.id]
		c.mu.Unlock()
		if dup {
			return fmt.Errorf("READ id %d reused: %w", h.id, ErrProtocol)
		}
		src, regs, err := c.a.resolveWire(segs)
		if err != nil {
			c.sendAsync(frError, h.id, encodeError(err))
			return nil
		}
		or := new(outRead)
		c.mu.Lock()
		c.outReads[h.id] = or
		c.mu.Unlock()
		c.a.wg.Add(1) // the reader is tracked, so the count is above zero
		go c.serveRead(h.id, or, src, regs, total)
		return nil

	case frWriteReq:
		b, err := c.body(h)
		if err != nil {
			return err
		}
		notif, segs, total, err := decodeWriteReq(b)
		if err != nil {
			return err
		}
		if _, dup := c.inWrites[h.id]; dup {
			return fmt.Errorf("WRITE id %d reused: %w", h.id, ErrProtocol)
		}
		dst, regs, err := c.a.resolveWire(segs)
		if err != nil {
			c.inWrites[h.id] = &inWrite{rejected: true, total: total}
			c.sendAsync(frError, h.id, encodeError(err))
			return nil
		}
		c.inWrites[h.id] = &inWrite{segs: dst, regs: regs, total: total, notif: notif}
		return nil

	case frRData:
		if _, err := io.ReadFull(c.br, scratch[:8]); err != nil {
			return err
		}
		off, n := binary.LittleEndian.Uint64(scratch), uint64(h.length)-8
		cl := c.lookup(h.id)
		if cl == nil {
			return c.discard(n) // abandoned
		}
		if cl.typ != frReadReq {
			return fmt.Errorf("RDATA for a %s request: %w", cl.typ, ErrProtocol)
		}
		cl.fill.Lock()
		if cl.abandoned {
			cl.fill.Unlock()
			return c.discard(n)
		}
		if off != cl.got || n > cl.total-cl.got {
			cl.fill.Unlock()
			return fmt.Errorf("RDATA at %d+%d, expected %d of %d: %w", off, n, cl.got, cl.total, ErrProtocol)
		}
		err := readInto(c.br, cl.segs, &cl.cur, n)
		cl.got += n
		done := cl.got == cl.total
		cl.fill.Unlock()
		if err != nil {
			return fmt.Errorf("reading RDATA: %w", err)
		}
		if h.flags&flagLast != 0 {
			if !done {
				return fmt.Errorf("last RDATA at %d of %d: %w", cl.got, cl.total, ErrProtocol)
			}
			c.finish(cl, nil)
		}
		return nil

	case frWData:
		if _, err := io.ReadFull(c.br, scratch[:8]); err != nil {
			return err
		}
		off, n := binary.LittleEndian.Uint64(scratch), uint64(h.length)-8
		if hook := testHookData; hook != nil {
			hook(frWData, off)
		}
		w := c.inWrites[h.id]
		if w == nil {
			return fmt.Errorf("WDATA for unknown WRITE %d: %w", h.id, ErrProtocol)
		}
		last := h.flags&flagLast != 0
		if off != w.got || n > w.total-w.got || (last && off+n != w.total) {
			return fmt.Errorf("WDATA at %d+%d, expected %d of %d: %w", off, n, w.got, w.total, ErrProtocol)
		}
		if w.rejected {
			w.got += n
			if last {
				delete(c.inWrites, h.id)
			}
			return c.discard(n)
		}
		if err := readInto(c.br, w.segs, &w.cur, n); err != nil {
			return fmt.Errorf("reading WDATA: %w", err)
		}
		w.got += n
		if last {
			delete(c.inWrites, h.id)
			for _, r := range w.regs {
				r.release()
			}
			if len(w.notif) > 0 {
				c.a.deliver(c.peer, w.notif)
			}
			c.sendAsync(frAck, h.id, nil)
		}
		return nil

	case frCancel:
		if w := c.inWrites[h.id]; w != nil {
			delete(c.inWrites, h.id)
			for _, r := range w.regs {
				r.release()
			}
		}
		c.mu.Lock()
		if or := c.outReads[h.id]; or != nil {
			or.canceled.Store(true)
		}
		c.mu.Unlock()
		return nil
	}
	return fmt.Errorf("unexpected %s: %w", h.typ, ErrProtocol)
}

// testHookData, when set by a test before agents start, runs before each data frame of a
// served READ is sent (frRData) and before each received WRITE data frame is read
// (frWData), with the frame's offset in the transfer.
var testHookData func(t frameType, off uint64)

// serveRead answers a peer's READ with data frames sent straight from registered memory.
func (c *conn) serveRead(id uint64, or *outRead, src [][]byte, regs []*Region, total uint64) {
	defer c.a.wg.Done()
	defer func() {
		for _, r := range regs {
			r.release()
		}
		c.mu.Lock()
		delete(c.outReads, id)
		c.mu.Unlock()
	}()
	chunk := uint64(c.a.cfg.ChunkSize)
	var cur cursor
	bufs := make(net.Buffers, 0, 8)
	for off := uint64(0); off < total; {
		if h := testHookData; h != nil {
			h(frRData, off)
		}
		n := min(chunk, total-off)
		bufs = append(bufs[:0], dataHeader(frRData, id, off, n, off+n == total))
		bufs = gather(bufs, src, &cur, n)
		if c.send(time.Now().Add(c.a.cfg.Timeout), bufs) != nil {
			return
		}
		off += n
		if or.canceled.Load() {
			return
		}
	}
}

// resolveWire checks a peer's segments against the registered regions and returns their
// memory; the regions are acquired and must be released by the caller.
func (a *Agent) resolveWire(segs []wireSeg) ([][]byte, []*Region, error) {
	t := a.local.Load()
	mem := make([][]byte, len(segs))
	var regs []*Region
	for i, s := range segs {
		r := t.byID[s.region]
		if r == nil {
			releaseAll(regs)
			return nil, nil, fmt.Errorf("segment %d: region %d: %w", i, s.region, ErrUnknownRegion)
		}
		if s.off > r.desc.Len || s.len > r.desc.Len-s.off {
			releaseAll(regs)
			return nil, nil, fmt.Errorf("segment %d: [%d,+%d) of region %d (%d bytes): %w", i, s.off, s.len, s.region, r.desc.Len, ErrOutOfRange)
		}
		if r.buf == nil {
			releaseAll(regs)
			return nil, nil, fmt.Errorf("segment %d: region %d: %w", i, s.region, ErrDeviceMemoryUnavailable)
		}
		if !containsRegion(regs, r) {
			if !r.acquire() {
				releaseAll(regs)
				return nil, nil, fmt.Errorf("segment %d: region %d deregistered: %w", i, s.region, ErrUnknownRegion)
			}
			regs = append(regs, r)
		}
		mem[i] = r.slice(s.off, s.len)
	}
	return mem, regs, nil
}

func containsRegion(regs []*Region, r *Region) bool {
	for _, x := range regs {
		if x == r {
			return true
		}
	}
	return false
}

func releaseAll(regs []*Region) {
	for _, r := range regs {
		r.release()
	}
}
