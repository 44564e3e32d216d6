package probes

import (
	"bufio"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"
)

// needRoot skips tests that load BPF programs where the process is not root.
func needRoot(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("loading eBPF programs needs root (CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN)")
	}
	cg, err := CgroupV2()
	if err != nil {
		t.Skipf("no cgroup v2: %v", err)
	}
	return cg
}

// echoServer answers each line read with "ok\n" after delay. It returns the address.
func echoServer(t *testing.T, delay time.Duration) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					if _, err := r.ReadString('\n'); err != nil {
						return
					}
					time.Sleep(delay)
					if _, err := io.WriteString(c, "ok\n"); err != nil {
						return
					}
				}
			}()
		}
	}()
	return netip.MustParseAddrPort(ln.Addr().String())
}

// roundTrips sends n POST-like requests on one connection to addr and reads each answer.
func roundTrips(t *testing.T, addr netip.AddrPort, n int) net.Conn {
	return roundTripsOf(t, addr, n, "POST / hello\n")
}

func roundTripsOf(t *testing.T, addr netip.AddrPort, n int, req string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp4", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	exchange(t, c, n, req)
	return c
}

// exchange sends req n times on c and reads each answer (one line).
func exchange(t *testing.T, c net.Conn, n int, req string) {
	t.Helper()
	r := bufio.NewReader(c)
	for range n {
		if _, err := io.WriteString(c, req); err != nil {
			t.Fatal(err)
		}
		if _, err := r.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
}

// watchFirstByte attaches first_byte to the cgroup v2 at cg watching addr, and closes it with
// the test.
func watchFirstByte(t *testing.T, cg string, addr netip.AddrPort) *FirstByte {
	t.Helper()
	p, err := AttachFirstByte(cg)
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	if err := p.SetTargets([]netip.AddrPort{addr}); err != nil {
		t.Fatal(err)
	}
	return p
}

// watchTCPConn attaches tcpconn to the cgroup v2 at cg watching addr, and closes it with the
// test.
func watchTCPConn(t *testing.T, cg string, addr netip.AddrPort) *TCPConn {
	t.Helper()
	p, err := AttachTCPConn(cg)
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	if err := p.SetTargets([]netip.AddrPort{addr}); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestTCPConn(t *testing.T) {
	cg := needRoot(t)
	addr := echoServer(t, 0)
	p := watchTCPConn(t, cg, addr)
	if !p.SockOps() || !p.SetState() {
		t.Fatalf("parts attached: sock_ops %v (%v), inet_sock_set_state %v (%v)", p.SockOps(), p.SockOpsErr, p.SetState(), p.SetStateErr)
	}
	for range 3 { // a new connection's RTT callback is armed for its first sample
		roundTrips(t, addr, 40).Close()
	}
	// An abort: close with SO_LINGER 0 sends a reset.
	c := roundTrips(t, addr, 1)
	_ = c.(*net.TCPConn).SetLinger(0)
	c.Close()

	stats, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	s := stats[addr]
	if s == nil {
		t.Fatalf("nothing seen for %s: %v", addr, stats)
	}
	if s.Connects < 4 || s.Connect.Count < 4 {
		t.Errorf("connects = %d (histogram %d), want ≥ 4", s.Connects, s.Connect.Count)
	}
	if s.Connect.Quantile(0.5) > uint64(time.Second) {
		t.Errorf("median connect latency %v on loopback", time.Duration(s.Connect.Quantile(0.5)))
	}
	if s.SRTT.Count == 0 {
		t.Error("no RTT samples")
	}
	if s.Resets < 1 {
		t.Errorf("resets = %d, want ≥ 1", s.Resets)
	}
	// Connections to other endpoints are not watched.
	other := echoServer(t, 0)
	roundTrips(t, other, 2).Close()
	stats, _ = p.Read()
	if stats[other] != nil {
		t.Errorf("unwatched endpoint %s recorded: %+v", other, stats[other])
	}
}

// A connection gives one srtt sample per Arm, however many requests it carries.
func TestTCPConnArm(t *testing.T) {
	cg := needRoot(t)
	addr := echoServer(t, 0)
	p := watchTCPConn(t, cg, addr)
	if p.ArmErr != nil {
		t.Fatalf("RTT callback re-arming: %v", p.ArmErr)
	}
	srtt := func() uint64 {
		t.Helper()
		stats, err := p.Read()
		if err != nil {
			t.Fatal(err)
		}
		if stats[addr] == nil {
			return 0
		}
		return stats[addr].SRTT.Count
	}
	c := roundTrips(t, addr, 30)
	defer c.Close()
	if n := srtt(); n != 1 {
		t.Fatalf("srtt samples after 30 round trips on a new connection: %d, want 1", n)
	}
	exchange(t, c, 30, "POST / more\n")
	if n := srtt(); n != 1 {
		t.Fatalf("srtt samples before Arm: %d, want still 1", n)
	}
	for want := uint64(2); want <= 3; want++ {
		if err := p.Arm(); err != nil {
			t.Fatal(err)
		}
		exchange(t, c, 30, "POST / armed\n")
		if n := srtt(); n != want {
			t.Fatalf("srtt samples after Arm and 30 round trips: %d, want %d", n, want)
		}
	}
}

// Where the re-arming iterator cannot run, the RTT callback stays on and one sample in eight
// is kept: a connection gives some samples per many round trips, not one, nor one each.
func TestTCPConnSampled(t *testing.T) {
	cg := needRoot(t)
	addr := echoServer(t, 0)
	p, err := attachTCPConn(cg, false)
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	defer p.Close()
	if err := p.SetTargets([]netip.AddrPort{addr}); err != nil {
		t.Fatal(err)
	}
	if p.ArmErr == nil || p.Arm() != nil {
		t.Fatalf("ArmErr %v: want the fallback, and Arm a no-op", p.ArmErr)
	}
	const trips = 400
	roundTrips(t, addr, trips).Close()
	stats, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	s := stats[addr]
	if s == nil {
		t.Fatalf("nothing seen for %s", addr)
	}
	// About trips/8 (one RTT callback per answer that acknowledges a request).
	t.Logf("srtt samples after %d round trips: %d", trips, s.SRTT.Count)
	if n := s.SRTT.Count; n < trips/8/4 || n > trips/2 {
		t.Errorf("srtt samples after %d round trips: %d, want about %d", trips, n, trips/8)
	}
}

func TestFirstByte(t *testing.T) {
	cg := needRoot(t)
	const delay = 50 * time.Millisecond
	addr := echoServer(t, delay)
	p := watchFirstByte(t, cg, addr)
	roundTrips(t, addr, 4).Close()
	roundTripsOf(t, addr, 3, "GET /metrics\n").Close() // not timed
	hs, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	h := hs[addr]
	if h == nil || h.Count != 4 {
		t.Fatalf("first-byte observations for %s: %+v, want 4 (the POSTs)", addr, h)
	}
	mean := time.Duration(h.SumNs / h.Count)
	if mean < delay || mean > delay+500*time.Millisecond {
		t.Errorf("mean first byte %v with an engine delay of %v", mean, delay)
	}
	for i := range h.Slots {
		if h.Slots[i] > 0 && uint64(1)<<(i+1) <= uint64(delay) {
			t.Errorf("observation below the delay in slot %d (< %v)", i, time.Duration(uint64(1)<<(i+1)))
		}
	}
}

func TestListenQ(t *testing.T) {
	needRoot(t)
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := netip.MustParseAddrPort(ln.Addr().String())
	p, err := AttachListenQ()
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	defer p.Close()
	const n = 5
	for range n { // never accepted: they wait in the accept queue
		c, err := net.Dial("tcp4", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	ls, err := p.Sample()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls {
		if l.Addr == addr {
			if l.Backlog != n || l.MaxBacklog < n {
				t.Errorf("listener %s: backlog %d of %d, want %d", addr, l.Backlog, l.MaxBacklog, n)
			}
			return
		}
	}
	t.Fatalf("listener %s not among %d sampled: %v", addr, len(ls), ls)
}

func TestRunQLat(t *testing.T) {
	needRoot(t)
	p, err := AttachRunQLat()
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	defer p.Close()
	if p.Attached() {
		t.Error("attached with no process to watch")
	}
	pid := uint32(os.Getpid())
	// Watched, not watched (the programs detach), watched again.
	for _, pids := range [][]uint32{{pid}, nil, {pid}} {
		if err := p.SetPIDs(pids); err != nil {
			t.Fatal(err)
		}
		if p.Attached() != (pids != nil) {
			t.Fatalf("SetPIDs(%v): attached %v", pids, p.Attached())
		}
	}
	// Threads of this process sleep and wake.
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				time.Sleep(time.Millisecond)
			}
		}()
	}
	wg.Wait()
	hs, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	h := hs[pid]
	if h == nil || h.Count == 0 {
		t.Fatalf("no run-queue latency recorded for pid %d: %v", pid, hs)
	}
	if med := time.Duration(h.Quantile(0.5)); med > time.Second {
		t.Errorf("median run-queue latency %v", med)
	}
	for k := range hs {
		if k != pid {
			t.Errorf("unwatched pid %d recorded", k)
		}
	}
}

func TestRunQLatSlots(t *testing.T) {
	needRoot(t)
	p, err := AttachRunQLat()
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	defer p.Close()
	pid, other := uint32(os.Getpid()), uint32(1<<22-1) // other: a process that never runs
	if err := p.SetPIDs([]uint32{pid}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // this process's threads wake and run
	if err := p.SetPIDs([]uint32{other, pid}); err != nil {
		t.Fatal(err)
	}
	if p.slots[0] != pid || p.slots[1] != other {
		t.Fatalf("slots %v: a watched process must keep its slot (0) and a new one take the next", p.slots[:2])
	}
	hs, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	if hs[pid] == nil || hs[pid].Count == 0 {
		t.Fatalf("pid %d: no run-queue latency after a re-set that kept it: %v", pid, hs)
	}
	// pid leaves: its slot is zeroed, the other keeps slot 1, and the kernel still compares both.
	if err := p.SetPIDs([]uint32{other}); err != nil {
		t.Fatal(err)
	}
	var h Hist
	if err := p.objs.Hists.Lookup(uint32(0), &h); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if err := p.objs.Hists.Lookup(uint32(0), &h); err != nil || h.Count != 0 {
		t.Fatalf("freed slot 0: %d observations (err %v), want 0: zeroed and no longer fed", h.Count, err)
	}
	var n uint32
	if err := p.objs.Nslots.Get(&n); err != nil || n != 2 || p.slots[1] != other {
		t.Fatalf("nslots %d slots %v (err %v), want 2 with %d in slot 1", n, p.slots[:2], err, other)
	}
	if err := p.SetPIDs(nil); err != nil {
		t.Fatal(err)
	}
	if err := p.objs.Nslots.Get(&n); err != nil || n != 0 {
		t.Fatalf("nslots %d (err %v) with nothing watched", n, err)
	}
	many := make([]uint32, MaxPIDs+1)
	for i := range many {
		many[i] = uint32(i + 1)
	}
	if err := p.SetPIDs(many); err == nil {
		t.Fatalf("%d processes accepted, at most %d", len(many), MaxPIDs)
	}
}

// An endpoint unwatched and watched again keeps its slot: its histogram stays cumulative and
// connections opened before are still timed.
func TestFirstByteRewatch(t *testing.T) {
	cg := needRoot(t)
	addr := echoServer(t, 5*time.Millisecond)
	other := echoServer(t, 0)
	p := watchFirstByte(t, cg, addr)
	c := roundTrips(t, addr, 2)
	defer c.Close()
	if err := p.SetTargets([]netip.AddrPort{other}); err != nil {
		t.Fatal(err)
	}
	if err := p.SetTargets([]netip.AddrPort{addr, other}); err != nil {
		t.Fatal(err)
	}
	exchange(t, c, 3, "POST / again\n")
	roundTrips(t, other, 1).Close()
	hs, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	if hs[addr] == nil || hs[addr].Count != 5 {
		t.Errorf("%s: %+v, want 5 observations (2 before, 3 after it was watched again)", addr, hs[addr])
	}
	if hs[other] == nil || hs[other].Count != 1 {
		t.Errorf("%s: %+v, want 1 observation", other, hs[other])
	}
}

func TestSlotTable(t *testing.T) {
	ep := func(i int) netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 8000)
	}
	var st slotTable
	ch, err := st.set([]netip.AddrPort{ep(2), ep(1), netip.MustParseAddrPort("[::1]:80")})
	if err != nil {
		t.Fatal(err)
	}
	if len(ch) != 2 || ch[0] != (slotChange{0, 1, false}) || ch[1] != (slotChange{1, 1, false}) || st.of[ep(1)] != 0 || st.of[ep(2)] != 1 {
		t.Fatalf("first set: changes %+v slots %v; want slots 0 and 1 in address order, generation 1, IPv6 ignored", ch, st.of)
	}
	// ep(1) leaves and comes back: same slot, no change for the kernel.
	if ch, err = st.set([]netip.AddrPort{ep(2)}); err != nil || len(ch) != 0 || st.live[ep(1)] {
		t.Fatalf("unwatch: %+v %v live %v", ch, err, st.live)
	}
	if ch, err = st.set([]netip.AddrPort{ep(1), ep(2)}); err != nil || len(ch) != 0 || st.of[ep(1)] != 0 || len(st.released) != 0 {
		t.Fatalf("rewatch: %+v %v of %v released %v", ch, err, st.of, st.released)
	}
	// Fill every slot, then replace ep(1): the released slot 0 goes to the newcomer, zeroed,
	// in a new generation.
	all := []netip.AddrPort{}
	for i := 1; i <= MaxSlots; i++ {
		all = append(all, ep(i))
	}
	if ch, err = st.set(all); err != nil || len(ch) != MaxSlots-2 {
		t.Fatalf("fill: %d changes, %v", len(ch), err)
	}
	if ch, err = st.set(append(all[1:], ep(MaxSlots+1))); err != nil {
		t.Fatal(err)
	}
	if len(ch) != 1 || ch[0] != (slotChange{0, 2, true}) || st.owner[0] != ep(MaxSlots+1) {
		t.Fatalf("recycle: %+v owner %v", ch, st.owner[0])
	}
	if _, ok := st.of[ep(1)]; ok {
		t.Fatal("the endpoint that lost its slot still maps to it")
	}
	// One more than fits: an error, and the others stay watched.
	if _, err = st.set(append(all, ep(MaxSlots+1))); err == nil {
		t.Fatalf("%d endpoints accepted, at most %d", MaxSlots+1, MaxSlots)
	}
	if len(st.live) != MaxSlots {
		t.Fatalf("%d watched after an overflow, want %d", len(st.live), MaxSlots)
	}
}

// A slot given to another endpoint starts from zero, and a connection that remembers the old
// endpoint's slot is no longer timed into it; once its endpoint is watched again (in another
// slot), the connection is timed into the new one.
func TestFirstByteSlotReuse(t *testing.T) {
	cg := needRoot(t)
	addr := echoServer(t, time.Millisecond)
	p := watchFirstByte(t, cg, addr)
	c := roundTrips(t, addr, 2)
	defer c.Close()
	// MaxSlots other endpoints: MaxSlots-1 fresh slots, then addr's slot, reused.
	others := make([]netip.AddrPort, MaxSlots)
	for i := range others {
		others[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)}), 7000)
	}
	if err := p.SetTargets(others); err != nil {
		t.Fatal(err)
	}
	newcomer := p.slots.owner[0]
	if newcomer == addr || p.slots.gen[0] != 2 {
		t.Fatalf("slot 0: owner %s generation %d, want another endpoint in generation 2", newcomer, p.slots.gen[0])
	}
	exchange(t, c, 2, "POST / again\n")
	hs, err := p.Read()
	if err != nil {
		t.Fatal(err)
	}
	if h := hs[newcomer]; h == nil || h.Count != 0 {
		t.Fatalf("reused slot of %s: %+v, want 0 observations (zeroed, and the old connection not timed)", newcomer, h)
	}
	if _, ok := hs[addr]; ok {
		t.Fatalf("%s still read after its slot went to another endpoint", addr)
	}
	// addr is watched again, in another slot: its open connection is timed again.
	if err := p.SetTargets(append(others[1:], addr)); err != nil {
		t.Fatal(err)
	}
	exchange(t, c, 2, "POST / watched again\n")
	if hs, err = p.Read(); err != nil {
		t.Fatal(err)
	}
	if h := hs[addr]; h == nil || h.Count != 2 {
		t.Fatalf("%s watched again in slot %d: %+v, want 2 observations on its old connection", addr, p.slots.of[addr], h)
	}
}
