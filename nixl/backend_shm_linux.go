//go:build linux

package nixl

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// shmBackend copies directly between this process and same-host peers' shared regions.
// Each agent serves its HostMem regions' memory files on an abstract Unix socket named in
// its metadata together with a host identity (the kernel boot id). A peer on the same
// host asks once per region, receives the file descriptor (SCM_RIGHTS), maps it, and from
// then on a READ or WRITE is a memcpy between its own memory and the mapping, with no
// involvement of the owning process; the notification follows on the TCP connection.
// Peers in another network namespace cannot reach the socket: the backend then reports
// ErrBackendUnavailable and the agent falls back to TCP.
type shmBackend struct {
	a    *Agent
	host string
	sock string // abstract socket name, without the leading '@'
	ln   *net.UnixListener
	info []byte

	mu     sync.Mutex
	closed bool
	peers  map[string]*shmPeer
	served map[*net.UnixConn]struct{}
	wg     sync.WaitGroup
}

// shmPeer is what this agent has mapped of one peer.
type shmPeer struct {
	sock   string
	mu     sync.Mutex // serialises mapping; guards maps and broken
	broken bool       // the socket was unreachable: use another backend
	maps   map[uint32]*shmMap
}

// shmMap is one peer region mapped into this process.
type shmMap struct {
	mem  []byte
	uses useCount
}

// defaultBackends prefers shared memory for same-host peers and falls back to TCP.
var defaultBackends = []BackendKind{BackendSHM, BackendTCP}

const (
	shmParallelMin = 4 << 20 // transfers at least this large are copied by several workers
	shmPiece       = 4 << 20 // copies check for cancellation between pieces this large
)

func newSHMBackend(a *Agent) (Backend, error) {
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, err
	}
	sock := fmt.Sprintf("kvrelay-nixl/%d/%s", os.Getpid(), hex.EncodeToString(rnd[:]))
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + sock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listening on abstract socket: %w", err)
	}
	b := &shmBackend{
		a:      a,
		host:   hostIdentity(),
		sock:   sock,
		ln:     ln,
		peers:  make(map[string]*shmPeer),
		served: make(map[*net.UnixConn]struct{}),
	}
	b.info = encodeSHMInfo(b.host, b.sock)
	b.wg.Add(1)
	go b.acceptLoop()
	return b, nil
}

// hostIdentity names the running kernel: agents with equal identities share a host.
func hostIdentity() string {
	if id, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		if s := strings.TrimSpace(string(id)); s != "" {
			return "boot:" + s
		}
	}
	h, _ := os.Hostname()
	return "host:" + h
}

// Kind returns BackendSHM.
func (b *shmBackend) Kind() BackendKind { return BackendSHM }

// Info returns the host identity and socket name.
func (b *shmBackend) Info() []byte { return b.info }

// CanCarry accepts transfers whose remote regions are all shared host memory of a peer
// on this host that has not proved unreachable.
func (b *shmBackend) CanCarry(req *Request) bool {
	info, ok := req.PeerMD.Backend(BackendSHM)
	if !ok {
		return false
	}
	host, sock, ok := parseSHMInfo(info)
	if !ok || host != b.host || sock == b.sock {
		return false
	}
	for _, s := range req.Remote {
		if !s.Region.Shared || s.Region.Mem != DRAM {
			return false
		}
	}
	for _, s := range req.Local {
		if s.Region.buf == nil {
			return false
		}
	}
	b.mu.Lock()
	p := b.peers[req.Peer]
	b.mu.Unlock()
	if p != nil && p.sock == sock {
		p.mu.Lock()
		defer p.mu.Unlock()
		return !p.broken
	}
	return true
}

// Transfer copies between local memory and the peer's mapped regions, then sends the
// notification over TCP.
func (b *shmBackend) Transfer(ctx context.Context, req *Request) error {
	info, _ := req.PeerMD.Backend(BackendSHM)
	_, sock, _ := parseSHMInfo(info)
	p, err := b.peer(req.Peer, sock)
	if err != nil {
		return err
	}
	maps := make([]*shmMap, 0, 1)
	defer func() {
		for _, m := range maps {
			m.uses.release()
		}
	}()
	remote := make([][]byte, len(req.Remote))
	for i, s := range req.Remote {
		m, err := p.mapping(ctx, s.Region)
		if err != nil {
			return err
		}
		if !containsMap(maps, m) {
			if !m.uses.acquire() {
				return fmt.Errorf("shared memory of %q unmapped: %w", req.Peer, ErrPeerGone)
			}
			maps = append(maps, m)
		}
		remote[i] = m.mem[s.Off : s.Off+s.Len : s.Off+s.Len]
	}
	local := make([][]byte, len(req.Local))
	for i, s := range req.Local {
		local[i] = s.Bytes()
	}
	dst, src := local, remote
	if req.Op == Write {
		dst, src = remote, local
	}
	if err := copySegs(ctx, dst, src, req.Total, b.a.cfg.CopyWorkers); err != nil {
		return err
	}
	if len(req.Notif) > 0 {
		c, err := b.a.peerConn(ctx, req.Peer)
		if err != nil {
			return fmt.Errorf("sending notification: %w", err)
		}
		return c.notify(ctx, req.Notif)
	}
	return nil
}

func containsMap(ms []*shmMap, m *shmMap) bool {
	for _, x := range ms {
		if x == m {
			return true
		}
	}
	return false
}

// peer returns the mapping state for a peer, replacing it when the peer's socket changed
// (the peer restarted under the same name).
func (b *shmBackend) peer(name, sock string) (*shmPeer, error) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, ErrClosed
	}
	p := b.peers[name]
	var stale *shmPeer
	if p == nil || p.sock != sock {
		stale = p
		p = &shmPeer{sock: sock, maps: make(map[uint32]*shmMap)}
		b.peers[name] = p
	}
	b.mu.Unlock()
	if stale != nil {
		stale.unmapAll()
	}
	return p, nil
}

// mapping returns the peer region mapped into this process, asking the peer for its
// memory file the first time.
func (p *shmPeer) mapping(ctx context.Context, r RegionDesc) (*shmMap, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if m := p.maps[r.ID]; m != nil {
		return m, nil
	}
	if p.broken {
		return nil, ErrBackendUnavailable
	}
	mem, err := fetchMapping(ctx, p.sock, r)
	if err != nil {
		if errors.Is(err, ErrBackendUnavailable) {
			p.broken = true
		}
		return nil, err
	}
	m := &shmMap{mem: mem}
	p.maps[r.ID] = m
	return m, nil
}

// unmapAll retires every mapping, waiting for transfers using them.
func (p *shmPeer) unmapAll() {
	p.mu.Lock()
	maps := p.maps
	p.maps = map[uint32]*shmMap{}
	p.broken = true
	p.mu.Unlock()
	for _, m := range maps {
		<-m.uses.kill()
		unix.Munmap(m.mem)
	}
}

// fetchMapping asks the peer's socket for region r's memory file and maps it.
func fetchMapping(ctx context.Context, sock string, r RegionDesc) ([]byte, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", "@"+sock)
	if err != nil {
		return nil, fmt.Errorf("reaching shared memory socket: %w: %w", ErrBackendUnavailable, err)
	}
	uc := nc.(*net.UnixConn)
	defer uc.Close()
	deadline := time.Now().Add(5 * time.Second)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	uc.SetDeadline(deadline)
	var req [4]byte
	binary.LittleEndian.PutUint32(req[:], r.ID)
	if _, err := uc.Write(req[:]); err != nil {
		return nil, fmt.Errorf("asking for region %d: %w: %w", r.ID, ErrBackendUnavailable, err)
	}
	var resp [2 + 8]byte
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := uc.ReadMsgUnix(resp[:], oob)
	if err != nil || n != len(resp) {
		return nil, fmt.Errorf("reading region %d reply (%d bytes): %w: %v", r.ID, n, ErrBackendUnavailable, err)
	}
	fd := -1
	if cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, cm := range cmsgs {
			if fds, err := unix.ParseUnixRights(&cm); err == nil {
				for _, f := range fds {
					if fd < 0 {
						fd = f
					} else {
						unix.Close(f)
					}
				}
			}
		}
	}
	if fd >= 0 {
		defer unix.Close(fd)
	}
	if code := binary.LittleEndian.Uint16(resp[:2]); code != 0 {
		return nil, fmt.Errorf("mapping region %d: %w", r.ID, &RemoteError{Code: code, Msg: "shared memory region refused"})
	}
	size := binary.LittleEndian.Uint64(resp[2:])
	if fd < 0 || size != r.Len {
		return nil, fmt.Errorf("region %d: file of %d bytes (want %d), fd %d: %w", r.ID, size, r.Len, fd, ErrBackendUnavailable)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping region %d: %w: %w", r.ID, ErrBackendUnavailable, err)
	}
	return mem, nil
}

// acceptLoop serves region requests from same-host peers.
func (b *shmBackend) acceptLoop() {
	defer b.wg.Done()
	for {
		uc, err := b.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(5 * time.Millisecond)
			continue
		}
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			uc.Close()
			return
		}
		b.served[uc] = struct{}{}
		b.wg.Add(1)
		b.mu.Unlock()
		go func() {
			defer b.wg.Done()
			b.serve(uc)
			b.mu.Lock()
			delete(b.served, uc)
			b.mu.Unlock()
			uc.Close()
		}()
	}
}

// serve answers region requests on one connection: each 4-byte region id gets a reply of
// u16 code (0 = granted) and u64 size, with the memory file attached when granted. Only
// processes of the same user (or root) are served.
func (b *shmBackend) serve(uc *net.UnixConn) {
	if !sameUser(uc) {
		return
	}
	for {
		uc.SetReadDeadline(time.Now().Add(b.a.cfg.Timeout))
		var req [4]byte
		if _, err := io.ReadFull(uc, req[:]); err != nil {
			return
		}
		id := binary.LittleEndian.Uint32(req[:])
		var resp [2 + 8]byte
		var oob []byte
		r := b.a.local.Load().byID[id]
		switch {
		case r == nil || r.host == nil || !r.host.Shareable():
			binary.LittleEndian.PutUint16(resp[:2], codeUnknownRegion)
		case !r.acquire():
			binary.LittleEndian.PutUint16(resp[:2], codeUnknownRegion)
			r = nil
		default:
			binary.LittleEndian.PutUint64(resp[2:], uint64(r.host.Len()))
			oob = unix.UnixRights(r.host.fd)
		}
		uc.SetWriteDeadline(time.Now().Add(b.a.cfg.Timeout))
		_, _, err := uc.WriteMsgUnix(resp[:], oob, nil)
		if oob != nil {
			r.release() // the peer holds its own descriptor now
		}
		if err != nil {
			return
		}
	}
}

// sameUser reports whether the connected process runs as this user or as root.
func sameUser(uc *net.UnixConn) bool {
	raw, err := uc.SyscallConn()
	if err != nil {
		return false
	}
	var cred *unix.Ucred
	raw.Control(func(fd uintptr) {
		cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	return err == nil && cred != nil && (cred.Uid == uint32(os.Getuid()) || cred.Uid == 0)
}

// ForgetPeer unmaps the peer's regions once transfers using them end.
func (b *shmBackend) ForgetPeer(name string) {
	b.mu.Lock()
	p := b.peers[name]
	delete(b.peers, name)
	b.mu.Unlock()
	if p != nil {
		p.unmapAll()
	}
}

// Close stops serving and unmaps every peer region.
func (b *shmBackend) Close() error {
	b.mu.Lock()
	b.closed = true
	peers := b.peers
	b.peers = map[string]*shmPeer{}
	for uc := range b.served {
		uc.Close()
	}
	b.mu.Unlock()
	err := b.ln.Close()
	b.wg.Wait()
	for _, p := range peers {
		p.unmapAll()
	}
	return err
}

// copySegs copies src[i] into dst[i] for every i (equal lengths, total bytes in all),
// split across up to workers goroutines for large transfers, checking ctx between pieces.
func copySegs(ctx context.Context, dst, src [][]byte, total uint64, workers int) error {
	if workers <= 1 || total < shmParallelMin {
		return copyRange(ctx, dst, src, 0, total)
	}
	per := (total + uint64(workers) - 1) / uint64(workers)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		start := uint64(w) * per
		if start >= total {
			break
		}
		end := min(total, start+per)
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = copyRange(ctx, dst, src, start, end)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// copyRange copies bytes [start, end) of the concatenated segments.
func copyRange(ctx context.Context, dst, src [][]byte, start, end uint64) error {
	i, pos := 0, start
	for i < len(src) && pos >= uint64(len(src[i])) {
		pos -= uint64(len(src[i]))
		i++
	}
	for left := end - start; left > 0; {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		k := min(uint64(len(src[i]))-pos, left, shmPiece)
		copy(dst[i][pos:pos+k], src[i][pos:pos+k])
		left -= k
		pos += k
		if pos == uint64(len(src[i])) {
			i++
			pos = 0
		}
	}
	return nil
}

var _ Backend = (*shmBackend)(nil)
