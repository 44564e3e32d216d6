package nixl

import (
	"bufio"
	"context"
	"crypto/sha256"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"testing"
	"time"
)

// tcpOnly configures an agent that moves data over TCP only.
func tcpOnly() Config { return Config{Backends: []BackendKind{BackendTCP}} }

// newAgent starts an agent closed at the end of the test.
func newAgent(t testing.TB, name string, cfg Config) *Agent {
	t.Helper()
	a, err := NewAgent(name, cfg)
	if err != nil {
		t.Fatalf("NewAgent(%q): %v", name, err)
	}
	t.Cleanup(func() {
		if err := a.Close(); err != nil {
			t.Errorf("closing %q: %v", name, err)
		}
	})
	return a
}

// loadMD loads b's metadata into a.
func loadMD(t testing.TB, a, b *Agent) {
	t.Helper()
	md, err := b.GetLocalMD()
	if err != nil {
		t.Fatal(err)
	}
	name, err := a.LoadRemoteMD(md)
	if err != nil || name != b.Name() {
		t.Fatalf("LoadRemoteMD = %q, %v; want %q", name, err, b.Name())
	}
}

// hostRegion allocates shareable memory of n bytes and registers it with a; at the end of
// the test it is deregistered (a no-op once the agent closed) and freed.
func hostRegion(t testing.TB, a *Agent, n int, opts ...RegisterOption) *Region {
	t.Helper()
	m, err := AllocHostMem(n)
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.RegisterHostMem(m, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a.DeregisterMem(r)
		if err := m.Free(); err != nil {
			t.Errorf("freeing host memory: %v", err)
		}
	})
	return r
}

// heapRegion registers n bytes of ordinary memory with a.
func heapRegion(t testing.TB, a *Agent, n int, opts ...RegisterOption) *Region {
	t.Helper()
	r, err := a.RegisterMem(make([]byte, n), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// fillRandom fills b with bytes from a seeded generator.
func fillRandom(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
}

// blocksSum is the SHA-256 of the given blocks of a region, concatenated in order.
func blocksSum(r *Region, blockSize int, ids []int) [32]byte {
	h := sha256.New()
	for _, id := range ids {
		h.Write(r.Bytes()[id*blockSize : (id+1)*blockSize])
	}
	var s [32]byte
	h.Sum(s[:0])
	return s
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// silentPeer listens on loopback, completes the handshake as name and then reads and
// ignores everything. It returns the address.
func silentPeer(t testing.TB, name string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, nc)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				br := bufio.NewReader(nc)
				if _, _, err := readHello(br, "", 0); err != nil {
					return
				}
				if writeFrameDirect(nc, frHello, 0, encodeHello(name, 1)) != nil {
					return
				}
				io.Copy(io.Discard, br)
			}()
		}
	}()
	return ln.Addr().String()
}

// testBackends lists the data backends this platform supports: TCP, and shared memory
// where it is available.
func testBackends() []BackendKind {
	if slices.Contains(defaultBackends, BackendSHM) {
		return []BackendKind{BackendTCP, BackendSHM}
	}
	return []BackendKind{BackendTCP}
}
