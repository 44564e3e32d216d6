package nixl

import (
	"errors"
	"testing"
	"time"
)

// A peer replaced at the same address by an agent of another name (vLLM names agents and
// engines afresh on every start) is found by Connect, which drops what it cached for the
// old one instead of failing on it forever.
func TestConnectPeerReplacedUnderNewName(t *testing.T) {
	old, err := NewAgent("prefill-run-1", tcpOnly())
	if err != nil {
		t.Fatal(err)
	}
	addr := old.Addr()
	dec := newAgent(t, "decode", tcpOnly())
	ctx := testCtx(t)
	if name, err := dec.Connect(ctx, addr); err != nil || name != "prefill-run-1" {
		t.Fatalf("Connect = %q, %v", name, err)
	}
	old.Close()

	newAgent(t, "prefill-run-2", Config{ListenAddr: addr, Backends: []BackendKind{BackendTCP}})
	name, err := dec.Connect(ctx, addr)
	for deadline := time.Now().Add(2 * time.Second); err == nil && name == "prefill-run-1" && time.Now().Before(deadline); {
		// The old connection may not have been seen closed yet; a later Connect sees it.
		time.Sleep(time.Millisecond)
		name, err = dec.Connect(ctx, addr)
	}
	if err != nil || name != "prefill-run-2" {
		t.Fatalf("Connect after the peer was replaced = %q, %v; want prefill-run-2", name, err)
	}
	if _, err := dec.RemoteMD("prefill-run-1"); !errors.Is(err, ErrUnknownAgent) {
		t.Errorf("the replaced peer's metadata is still loaded: %v", err)
	}
}
