package nixl

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestHelperAgentProcess is not a test: TestPeerProcessKilled runs the test binary with
// NIXL_HELPER_AGENT set, and this function then serves as the peer process. It registers
// a region, prints its address, serves READs slowly (1 ms per 64 KiB frame) and waits to
// be killed.
func TestHelperAgentProcess(t *testing.T) {
	if os.Getenv("NIXL_HELPER_AGENT") != "1" {
		t.Skip("helper process for TestPeerProcessKilled")
	}
	testHookData = func(frameType, uint64) { time.Sleep(time.Millisecond) }
	a, err := NewAgent("doomed", Config{ChunkSize: 64 << 10, Backends: []BackendKind{BackendTCP}})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	buf := make([]byte, 64<<20)
	fillRandom(buf, 99)
	if _, err := a.RegisterMem(buf, WithRegionName("kv")); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("addr", a.Addr())
	select {}
}

// The peer process dies (SIGKILL) in the middle of a large READ: the transfer fails with
// ErrPeerGone promptly instead of hanging.
func TestPeerProcessKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperAgentProcess$")
	cmd.Env = append(os.Environ(), "NIXL_HELPER_AGENT=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	sc := bufio.NewScanner(out)
	var addr string
	for sc.Scan() {
		if a, ok := strings.CutPrefix(sc.Text(), "addr "); ok {
			addr = a
			break
		}
	}
	if addr == "" {
		t.Fatal("helper process printed no address")
	}

	ini := newAgent(t, "survivor", tcpOnly())
	lr := heapRegion(t, ini, 64<<20)
	peer, err := ini.Connect(testCtx(t), addr)
	if err != nil {
		t.Fatal(err)
	}
	md, _ := ini.RemoteMD(peer)
	kv, _ := md.Region("kv")
	x, err := ini.CreateXfer(Read, DescList{Descs: []Desc{lr.Desc().Whole()}}, peer, DescList{Descs: []Desc{kv.Whole()}})
	if err != nil {
		t.Fatal(err)
	}
	if err := x.Post(context.Background()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // the READ takes over a second at the helper's pace
	if s := x.State(); s != StateInProgress {
		t.Fatalf("state %v before the kill, want InProgress (err %v)", s, x.Err())
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = x.Wait(ctx)
	if !errors.Is(err, ErrPeerGone) {
		t.Fatalf("err = %v, want ErrPeerGone", err)
	}
	t.Logf("failed %v after the kill: %v", time.Since(start).Round(time.Millisecond), err)
}
