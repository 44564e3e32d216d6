package nixl

import (
	"bufio"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Config configures an Agent. A zero field takes its default (see DefaultConfig), so
// Config{ListenAddr: "127.0.0.1:0"} is a complete configuration.
type Config struct {
	// ListenAddr is the TCP address the agent listens on for peers: their data
	// transfers, metadata requests and notifications. Default "127.0.0.1:0".
	ListenAddr string
	// AdvertiseAddr is the host:port published in metadata for peers to dial. Default: the
	// bound listen address.
	AdvertiseAddr string
	// Backends lists the data backends in order of preference. The first one both agents
	// share and that can carry a transfer is used. It must contain BackendTCP, which also
	// carries control traffic. Default: shared memory, then TCP (TCP alone off Linux).
	Backends []BackendKind
	// Timeout bounds each transfer (overridable per transfer with WithTimeout) and every
	// stalled read or write on a connection. Default 30s.
	Timeout time.Duration
	// DialTimeout bounds connecting to a peer and the handshake. Default 5s.
	DialTimeout time.Duration
	// ChunkSize is the largest payload of one data frame on TCP: large enough to keep
	// per-frame costs negligible, small enough that concurrent transfers on one connection
	// interleave. Default 8 MiB, at most 64 MiB.
	ChunkSize int
	// SocketBuffer, when positive, sets SO_SNDBUF and SO_RCVBUF on every connection.
	// Default 0: the kernel's autotuning, which on Linux outperforms a fixed size capped by
	// net.core.[rw]mem_max.
	SocketBuffer int
	// CopyWorkers is how many goroutines copy one shared-memory transfer of 4 MiB or more.
	// Default min(GOMAXPROCS, 4).
	CopyWorkers int
}

// DefaultConfig returns the configuration NewAgent uses for fields left zero.
func DefaultConfig() Config {
	return Config{
		ListenAddr:  "127.0.0.1:0",
		Backends:    slices.Clone(defaultBackends),
		Timeout:     30 * time.Second,
		DialTimeout: 5 * time.Second,
		ChunkSize:   8 << 20,
		CopyWorkers: min(runtime.GOMAXPROCS(0), 4),
	}
}

// withDefaults fills zero fields from DefaultConfig.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.ListenAddr == "" {
		c.ListenAddr = d.ListenAddr
	}
	if len(c.Backends) == 0 {
		c.Backends = d.Backends
	}
	if c.Timeout == 0 {
		c.Timeout = d.Timeout
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = d.DialTimeout
	}
	if c.ChunkSize == 0 {
		c.ChunkSize = d.ChunkSize
	}
	if c.CopyWorkers == 0 {
		c.CopyWorkers = d.CopyWorkers
	}
	return c
}

// Validate reports settings NewAgent would reject (after defaults are applied).
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.Timeout < 0 || c.DialTimeout < 0:
		return fmt.Errorf("negative timeout: %w", ErrInvalidConfig)
	case c.ChunkSize < 4<<10 || c.ChunkSize > maxDataChunk:
		return fmt.Errorf("chunk size %d outside [4 KiB, 64 MiB]: %w", c.ChunkSize, ErrInvalidConfig)
	case c.SocketBuffer < 0 || c.CopyWorkers < 0:
		return fmt.Errorf("negative socket buffer or copy workers: %w", ErrInvalidConfig)
	case !slices.Contains(c.Backends, BackendTCP):
		return fmt.Errorf("backends %v lack %q: %w", c.Backends, BackendTCP, ErrInvalidConfig)
	}
	for i, k := range c.Backends {
		if _, ok := backendFactories[k]; !ok {
			return fmt.Errorf("unknown backend %q: %w", k, ErrInvalidConfig)
		}
		if slices.Contains(c.Backends[:i], k) {
			return fmt.Errorf("backend %q listed twice: %w", k, ErrInvalidConfig)
		}
	}
	return nil
}

// Agent is one endpoint of KV block transfers, modelled on a NIXL agent: it has a unique
// name, registers memory regions, publishes metadata describing them and its backends,
// loads peers' metadata, and runs one-sided READ and WRITE transfers between its regions
// and a peer's, with notifications. It listens on a TCP port from NewAgent until Close.
//
// All methods are safe for concurrent use.
type Agent struct {
	name      string
	instance  uint64
	cfg       Config
	ln        net.Listener
	advertise string
	backends  []Backend

	local atomic.Pointer[localTable] // registered regions, replaced on every change

	mu         sync.Mutex
	closed     bool
	nextRegion uint32
	remotes    map[string]*remote
	conns      map[string]*conn // the connection used to reach each peer
	live       map[*conn]struct{}
	handshakes map[net.Conn]struct{} // accepted, handshake not finished

	notifMu sync.Mutex
	notifs  map[string][][]byte
	notifCh chan struct{}

	wg sync.WaitGroup // accept loop, connection readers, served READs, posted transfers
}

// localTable is an immutable snapshot of the registered regions.
type localTable struct {
	set  regionSet          // sorted descriptions
	regs []*Region          // parallel to set.regions
	byID map[uint32]*Region // for requests from peers
}

// remote is a loaded peer: its metadata and where to dial it. Replaced, never modified.
type remote struct {
	md     *Metadata
	set    *regionSet
	byID   map[uint32]RegionDesc
	addr   string // TCP address to dial
	dialMu *sync.Mutex
}

// NewAgent starts an agent named name (unique among the agents that talk to each other):
// it listens on cfg.ListenAddr and serves peers until Close.
func NewAgent(name string, cfg Config) (*Agent, error) {
	if name == "" || len(name) > mdMaxName {
		return nil, fmt.Errorf("agent name of %d bytes: %w", len(name), ErrInvalidConfig)
	}
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("starting agent %q: %w", name, err)
	}
	a := &Agent{
		name:       name,
		cfg:        cfg,
		ln:         ln,
		advertise:  cfg.AdvertiseAddr,
		remotes:    make(map[string]*remote),
		conns:      make(map[string]*conn),
		live:       make(map[*conn]struct{}),
		handshakes: make(map[net.Conn]struct{}),
		notifs:     make(map[string][][]byte),
		notifCh:    make(chan struct{}, 1),
	}
	if a.advertise == "" {
		a.advertise = ln.Addr().String()
	}
	var inst [8]byte
	if _, err := rand.Read(inst[:]); err != nil {
		ln.Close()
		return nil, fmt.Errorf("starting agent %q: %w", name, err)
	}
	a.instance = binary.LittleEndian.Uint64(inst[:])
	a.local.Store(&localTable{byID: map[uint32]*Region{}})
	for _, k := range cfg.Backends {
		b, err := backendFactories[k](a)
		if err != nil {
			ln.Close()
			for _, b := range a.backends {
				b.Close()
			}
			return nil, fmt.Errorf("starting agent %q: backend %s: %w", name, k, err)
		}
		a.backends = append(a.backends, b)
	}
	a.wg.Add(1)
	go a.acceptLoop()
	return a, nil
}

// Name returns the agent's name.
func (a *Agent) Name() string { return a.name }

// Addr returns the bound TCP listen address (host:port), for example to publish in
// vLLM's kv_transfer_params as remote_host and remote_port.
func (a *Agent) Addr() string { return a.ln.Addr().String() }

// Backends lists the kinds of the agent's backends in order of preference.
func (a *Agent) Backends() []BackendKind {
	ks := make([]BackendKind, len(a.backends))
	for i, b := range a.backends {
		ks[i] = b.Kind()
	}
	return ks
}

// Close stops the agent: it closes the listener and every connection (transfers in flight
// fail with ErrClosed), waits for its goroutines, releases backends and drops every
// registration, so HostMem registered with it can then be freed. Close is idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	conns := make([]*conn, 0, len(a.live))
	for c := range a.live {
		conns = append(conns, c)
	}
	for nc := range a.handshakes {
		nc.Close()
	}
	a.mu.Unlock()

	err := a.ln.Close()
	for _, c := range conns {
		c.fail(ErrClosed)
	}
	a.wg.Wait()
	for _, b := range a.backends {
		if berr := b.Close(); err == nil {
			err = berr
		}
	}
	t := a.local.Swap(&localTable{byID: map[uint32]*Region{}})
	for _, r := range t.regs {
		<-r.kill()
		r.unregistered()
	}
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (a *Agent) isClosed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.closed
}

// track counts a goroutine the agent must wait for on Close; false once closed.
func (a *Agent) track() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return false
	}
	a.wg.Add(1)
	return true
}

// RegisterMem registers host memory. The region is reachable by peers over TCP; to make
// it reachable over shared memory as well, allocate it with AllocHostMem and use
// RegisterHostMem. buf must stay allocated and must not overlap a registered region.
func (a *Agent) RegisterMem(buf []byte, opts ...RegisterOption) (*Region, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("registering empty memory: %w", ErrInvalidDesc)
	}
	r := &Region{desc: RegionDesc{Mem: DRAM, Addr: sliceAddr(buf), Len: uint64(len(buf))}, buf: buf}
	return a.register(r, opts)
}

// RegisterHostMem registers shareable host memory: same-host peers reach it over shared
// memory, others over TCP. m cannot be freed while registered.
func (a *Agent) RegisterHostMem(m *HostMem, opts ...RegisterOption) (*Region, error) {
	if err := m.addReg(); err != nil {
		return nil, err
	}
	r := &Region{
		desc: RegionDesc{Mem: DRAM, Addr: sliceAddr(m.buf), Len: uint64(len(m.buf)), Shared: m.Shareable()},
		buf:  m.buf,
		host: m,
	}
	reg, err := a.register(r, opts)
	if err != nil {
		m.dropReg()
	}
	return reg, err
}

// RegisterDeviceMem registers size bytes of device memory at ptr on device devID. This
// package has no device support, so it returns ErrDeviceMemoryUnavailable.
func (a *Agent) RegisterDeviceMem(devID uint32, ptr uintptr, size uint64, opts ...RegisterOption) (*Region, error) {
	if size == 0 {
		return nil, fmt.Errorf("registering empty device memory: %w", ErrInvalidDesc)
	}
	dev, err := registerDevice(devID, ptr, size)
	if err != nil {
		return nil, fmt.Errorf("registering %d bytes on device %d: %w", size, devID, err)
	}
	r := &Region{desc: RegionDesc{Mem: VRAM, DevID: devID, Addr: uint64(ptr), Len: size}, dev: dev}
	reg, err := a.register(r, opts)
	if err != nil {
		dev.deregister()
	}
	return reg, err
}

func (a *Agent) register(r *Region, opts []RegisterOption) (*Region, error) {
	for _, o := range opts {
		o(&r.desc)
	}
	if len(r.desc.Name) > mdMaxName {
		return nil, fmt.Errorf("registering region named %.32q…: name too long: %w", r.desc.Name, ErrInvalidDesc)
	}
	if checkDesc(r.desc.Whole()) != nil {
		return nil, fmt.Errorf("registering region: %w", ErrInvalidDesc)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, ErrClosed
	}
	old := a.local.Load()
	if overlapsAny(old.set.regions, r.desc) {
		return nil, fmt.Errorf("registering %d bytes at %#x: %w", r.desc.Len, r.desc.Addr, ErrOverlap)
	}
	a.nextRegion++
	r.desc.ID = a.nextRegion
	regs := append(slices.Clone(old.regs), r)
	a.local.Store(newLocalTable(regs))
	return r, nil
}

// DeregisterMem removes a region. It waits for transfers using the region (local ones and
// peers' requests being served) to finish; later transfers addressing it fail with
// ErrUnknownRegion. Peers holding a mapping of shared memory keep the memory alive until
// they unmap it (InvalidateRemoteMD or Close on their side).
func (a *Agent) DeregisterMem(r *Region) error {
	a.mu.Lock()
	old := a.local.Load()
	i := slices.Index(old.regs, r)
	if i < 0 {
		a.mu.Unlock()
		return fmt.Errorf("deregistering region: %w", ErrUnknownRegion)
	}
	a.local.Store(newLocalTable(slices.Delete(slices.Clone(old.regs), i, i+1)))
	a.mu.Unlock()
	<-r.kill()
	r.unregistered()
	return nil
}

// unregistered releases what registration took, once no transfer uses the region.
func (r *Region) unregistered() {
	if r.host != nil {
		r.host.dropReg()
	}
	if r.dev != nil {
		r.dev.deregister()
	}
}

func newLocalTable(regs []*Region) *localTable {
	slices.SortFunc(regs, func(x, y *Region) int {
		a, b := &x.desc, &y.desc
		switch {
		case regionKeyLess(a.Mem, a.DevID, a.Addr, b):
			return -1
		case regionKeyLess(b.Mem, b.DevID, b.Addr, a):
			return 1
		}
		return 0
	})
	t := &localTable{regs: regs, byID: make(map[uint32]*Region, len(regs))}
	t.set.regions = make([]RegionDesc, len(regs))
	for i, r := range regs {
		t.set.regions[i] = r.desc
		t.byID[r.desc.ID] = r
	}
	return t
}

// Regions returns the descriptions of the registered regions, ordered by id.
func (a *Agent) Regions() []RegionDesc {
	rs := slices.Clone(a.local.Load().set.regions)
	slices.SortFunc(rs, func(x, y RegionDesc) int { return cmp.Compare(x.ID, y.ID) })
	return rs
}

// LocalMD returns the agent's metadata: name, backends with their connection info, and
// every registered region.
func (a *Agent) LocalMD() *Metadata {
	m := &Metadata{Name: a.name, Instance: a.instance, Regions: a.Regions()}
	for _, b := range a.backends {
		m.Backends = append(m.Backends, BackendInfo{Kind: b.Kind(), Info: b.Info()})
	}
	return m
}

// GetLocalMD returns the agent's metadata encoded for a peer's LoadRemoteMD, to hand over
// through a control plane. Peers can also fetch it directly with Connect.
func (a *Agent) GetLocalMD() ([]byte, error) { return a.LocalMD().MarshalBinary() }

// LoadRemoteMD decodes a peer's metadata and makes the peer addressable by the name it
// returns. Loading metadata for a name already loaded replaces it; connections stay.
func (a *Agent) LoadRemoteMD(md []byte) (string, error) {
	m, err := DecodeMetadata(md)
	if err != nil {
		return "", err
	}
	addr, _ := m.Backend(BackendTCP)
	if err := a.loadRemote(m, string(addr)); err != nil {
		return "", err
	}
	return m.Name, nil
}

func (a *Agent) loadRemote(m *Metadata, addr string) error {
	if m.Name == a.name {
		return fmt.Errorf("loading metadata of agent %q: %w", m.Name, ErrNameConflict)
	}
	r := &remote{md: m, set: newRegionSet(m.Regions), byID: make(map[uint32]RegionDesc, len(m.Regions)), addr: addr}
	for _, rd := range m.Regions {
		r.byID[rd.ID] = rd
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	if old := a.remotes[m.Name]; old != nil {
		r.dialMu = old.dialMu
		if r.addr == "" {
			r.addr = old.addr
		}
	} else {
		r.dialMu = new(sync.Mutex)
	}
	a.remotes[m.Name] = r
	return nil
}

// Connect fetches the metadata of the agent listening at addr (host:port, for example
// vLLM's remote_host and remote_port) over its TCP port, loads it, keeps the connection
// for transfers, and returns the peer's name. A peer already loaded from the same address
// is not fetched again unless another agent or instance now answers there (until the
// connection to the old one is seen closed, Connect still returns the old name);
// InvalidateRemoteMD forces a fresh fetch.
func (a *Agent) Connect(ctx context.Context, addr string) (string, error) {
	a.mu.Lock()
	cached := ""
	for name, r := range a.remotes {
		if r.addr == addr {
			cached = name
			break
		}
	}
	a.mu.Unlock()
	if cached != "" {
		// Reuse the metadata unless the peer restarted since it was loaded, as a new
		// instance or as an agent of another name (engines that name agents afresh on
		// every start); then the old peer is gone from addr and its metadata with it.
		_, err := a.peerConn(ctx, cached)
		if !errors.Is(err, ErrStaleMetadata) && !errors.Is(err, ErrNameConflict) {
			return cached, err
		}
		a.InvalidateRemoteMD(cached)
	}
	c, err := a.dial(ctx, addr, "", 0)
	if err != nil {
		return "", err
	}
	if !a.addConn(c) {
		c.nc.Close()
		return "", ErrClosed
	}
	body, err := c.fetchMD(ctx)
	if err != nil {
		c.fail(err)
		return "", fmt.Errorf("fetching metadata from %s: %w", addr, err)
	}
	m, err := DecodeMetadata(body)
	if err == nil && (m.Name != c.peer || m.Instance != c.inst) {
		err = fmt.Errorf("peer at %s introduced itself as %q (instance %x) but its metadata names %q (instance %x): %w", addr, c.peer, c.inst, m.Name, m.Instance, ErrNameConflict)
	}
	if err == nil {
		err = a.loadRemote(m, addr)
	}
	if err != nil {
		c.fail(err)
		return "", fmt.Errorf("loading metadata from %s: %w", addr, err)
	}
	return m.Name, nil
}

// RemoteMD returns the loaded metadata of a peer. The result must not be modified.
func (a *Agent) RemoteMD(name string) (*Metadata, error) {
	r := a.remote(name)
	if r == nil {
		return nil, fmt.Errorf("agent %q: %w", name, ErrUnknownAgent)
	}
	return r.md, nil
}

// Region returns the peer region with the given name (set with WithRegionName), or,
// for name "", the region when the peer has exactly one.
func (m *Metadata) Region(name string) (RegionDesc, bool) {
	if name == "" {
		if len(m.Regions) == 1 {
			return m.Regions[0], true
		}
		return RegionDesc{}, false
	}
	for _, r := range m.Regions {
		if r.Name == name {
			return r, true
		}
	}
	return RegionDesc{}, false
}

func (a *Agent) remote(name string) *remote {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.remotes[name]
}

// InvalidateRemoteMD forgets a peer: its metadata, its connections (transfers in flight
// with it fail) and what backends hold for it, such as shared-memory mappings.
func (a *Agent) InvalidateRemoteMD(name string) error {
	a.mu.Lock()
	_, known := a.remotes[name]
	delete(a.remotes, name)
	var conns []*conn
	for c := range a.live {
		if c.peer == name {
			conns = append(conns, c)
		}
	}
	a.mu.Unlock()
	if !known && len(conns) == 0 {
		return fmt.Errorf("invalidating agent %q: %w", name, ErrUnknownAgent)
	}
	for _, c := range conns {
		c.fail(fmt.Errorf("metadata of %q invalidated", name))
	}
	for _, b := range a.backends {
		b.ForgetPeer(name)
	}
	return nil
}

// RemoveRemoteAgent is InvalidateRemoteMD under the name NIXL's Python API uses.
func (a *Agent) RemoveRemoteAgent(name string) error { return a.InvalidateRemoteMD(name) }

// GenNotif sends a notification to a peer, outside any transfer. The peer must be loaded
// or connected to this agent.
func (a *Agent) GenNotif(ctx context.Context, peer string, msg []byte) error {
	if len(msg) > maxNotif {
		return fmt.Errorf("notification of %d bytes exceeds %d: %w", len(msg), maxNotif, ErrInvalidDesc)
	}
	c, err := a.peerConn(ctx, peer)
	if err != nil {
		return err
	}
	return c.notify(ctx, msg)
}

// GetNotifs returns and clears the notifications received so far, by sending agent, in
// arrival order per agent. It returns nil when there are none.
func (a *Agent) GetNotifs() map[string][][]byte {
	a.notifMu.Lock()
	defer a.notifMu.Unlock()
	if len(a.notifs) == 0 {
		return nil
	}
	n := a.notifs
	a.notifs = make(map[string][][]byte)
	return n
}

// Notified returns a channel that receives a value after notifications arrive; GetNotifs
// then returns them. One value may stand for several notifications.
func (a *Agent) Notified() <-chan struct{} { return a.notifCh }

// WaitNotifs blocks until at least one notification has arrived, then returns and clears
// them like GetNotifs.
func (a *Agent) WaitNotifs(ctx context.Context) (map[string][][]byte, error) {
	for {
		if n := a.GetNotifs(); n != nil {
			return n, nil
		}
		select {
		case <-a.notifCh:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// deliver queues a notification received from peer. msg must not be retained elsewhere.
func (a *Agent) deliver(from string, msg []byte) {
	a.notifMu.Lock()
	a.notifs[from] = append(a.notifs[from], msg)
	a.notifMu.Unlock()
	select {
	case a.notifCh <- struct{}{}:
	default:
	}
}

// acceptLoop accepts peers' connections until the listener closes.
func (a *Agent) acceptLoop() {
	defer a.wg.Done()
	for {
		nc, err := a.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Temporary failures (EMFILE and the like): back off briefly.
			time.Sleep(5 * time.Millisecond)
			continue
		}
		if !a.track() {
			nc.Close()
			return
		}
		go func() {
			defer a.wg.Done()
			a.serveConn(nc)
		}()
	}
}

// serveConn runs the handshake on an accepted connection, then its reader.
func (a *Agent) serveConn(nc net.Conn) {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		nc.Close()
		return
	}
	a.handshakes[nc] = struct{}{}
	a.mu.Unlock()
	a.tune(nc)
	nc.SetDeadline(time.Now().Add(a.cfg.DialTimeout))
	br := bufio.NewReaderSize(nc, readBufSize)
	name, inst, err := readHello(br, "", 0)
	if err == nil && name == a.name {
		err = fmt.Errorf("peer uses this agent's name %q: %w", name, ErrNameConflict)
	}
	if err == nil {
		err = writeFrameDirect(nc, frHello, 0, encodeHello(a.name, a.instance))
	} else {
		writeFrameDirect(nc, frError, 0, encodeError(err))
	}
	a.mu.Lock()
	delete(a.handshakes, nc)
	if err != nil || a.closed {
		a.mu.Unlock()
		nc.Close()
		return
	}
	nc.SetDeadline(time.Time{})
	c := newConn(a, nc, br, name, inst)
	a.live[c] = struct{}{}
	// The peer's connection also carries this agent's requests to it, unless the loaded
	// metadata belongs to an earlier run of the peer.
	if r := a.remotes[name]; r == nil || r.md.Instance == inst {
		if old := a.conns[name]; old == nil || old.isDead() {
			a.conns[name] = c
		}
	}
	a.mu.Unlock()
	c.readLoop()
}

// dial connects to the agent at addr and runs the handshake. When expect is not empty the
// peer must be called so, and when inst is not zero it must be that instance.
func (a *Agent) dial(ctx context.Context, addr, expect string, inst uint64) (*conn, error) {
	d := net.Dialer{Timeout: a.cfg.DialTimeout, KeepAlive: 15 * time.Second}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w: %w", addr, ErrPeerGone, err)
	}
	a.tune(nc)
	deadline := time.Now().Add(a.cfg.DialTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	nc.SetDeadline(deadline)
	br := bufio.NewReaderSize(nc, readBufSize)
	name, peerInst, err := func() (string, uint64, error) {
		if err := writeFrameDirect(nc, frHello, 0, encodeHello(a.name, a.instance)); err != nil {
			return "", 0, err
		}
		return readHello(br, expect, inst)
	}()
	if err == nil && name == a.name {
		err = fmt.Errorf("peer at %s uses this agent's name %q: %w", addr, name, ErrNameConflict)
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("handshake with %s: %w", addr, err)
	}
	nc.SetDeadline(time.Time{})
	return newConn(a, nc, br, name, peerInst), nil
}

// addConn makes a dialed connection live and starts its reader; false once closed.
func (a *Agent) addConn(c *conn) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return false
	}
	a.live[c] = struct{}{}
	if old := a.conns[c.peer]; old == nil || old.isDead() {
		a.conns[c.peer] = c
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		c.readLoop()
	}()
	return true
}

// dropConn forgets a failed connection.
func (a *Agent) dropConn(c *conn) {
	a.mu.Lock()
	delete(a.live, c)
	if a.conns[c.peer] == c {
		delete(a.conns, c.peer)
	}
	a.mu.Unlock()
}

// peerConn returns the live connection to the named peer, dialing it when there is none
// and its metadata is loaded.
func (a *Agent) peerConn(ctx context.Context, name string) (*conn, error) {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil, ErrClosed
	}
	c, r := a.conns[name], a.remotes[name]
	a.mu.Unlock()
	if c != nil && !c.isDead() {
		return c, nil
	}
	if r == nil {
		return nil, fmt.Errorf("agent %q: %w", name, ErrUnknownAgent)
	}
	r.dialMu.Lock()
	defer r.dialMu.Unlock()
	a.mu.Lock()
	c = a.conns[name]
	a.mu.Unlock()
	if c != nil && !c.isDead() {
		return c, nil
	}
	if r.addr == "" {
		return nil, fmt.Errorf("agent %q publishes no TCP address: %w", name, ErrNoBackend)
	}
	c, err := a.dial(ctx, r.addr, name, r.md.Instance)
	if err != nil {
		return nil, err
	}
	if !a.addConn(c) {
		c.nc.Close()
		return nil, ErrClosed
	}
	return c, nil
}

// tune applies socket options to a new connection.
func (a *Agent) tune(nc net.Conn) {
	tc, ok := nc.(*net.TCPConn)
	if !ok {
		return
	}
	tc.SetNoDelay(true)
	if n := a.cfg.SocketBuffer; n > 0 {
		tc.SetReadBuffer(n)
		tc.SetWriteBuffer(n)
	}
}

// readHello reads the peer's HELLO (or its ERROR) and returns the peer's name and
// instance, checking them against expect and inst where those are set.
func readHello(br *bufio.Reader, expect string, inst uint64) (string, uint64, error) {
	var hb [hdrSize]byte
	if _, err := io.ReadFull(br, hb[:]); err != nil {
		return "", 0, fmt.Errorf("reading handshake: %w", err)
	}
	h, err := parseHeader(hb[:])
	if err != nil {
		return "", 0, err
	}
	if h.typ != frHello && h.typ != frError {
		return "", 0, fmt.Errorf("handshake: got %s: %w", h.typ, ErrProtocol)
	}
	body := make([]byte, h.length)
	if _, err := io.ReadFull(br, body); err != nil {
		return "", 0, fmt.Errorf("reading handshake: %w", err)
	}
	if h.typ == frError {
		return "", 0, decodeError(expect, body)
	}
	name, peerInst, err := decodeHello(body)
	if err != nil {
		return "", 0, err
	}
	if expect != "" && name != expect {
		return "", 0, fmt.Errorf("expected agent %q, reached %q: %w", expect, name, ErrNameConflict)
	}
	if inst != 0 && peerInst != inst {
		return "", 0, fmt.Errorf("agent %q is instance %x, metadata is of %x: %w", name, peerInst, inst, ErrStaleMetadata)
	}
	return name, peerInst, nil
}

// writeFrameDirect writes one frame outside a conn (during the handshake).
func writeFrameDirect(nc net.Conn, t frameType, id uint64, body []byte) error {
	b := make([]byte, hdrSize, hdrSize+len(body))
	putHeader(b, frameHeader{length: uint32(len(body)), typ: t, id: id})
	_, err := nc.Write(append(b, body...))
	return err
}
