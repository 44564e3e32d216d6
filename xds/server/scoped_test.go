package server

import (
	"fmt"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"

	"github.com/kvrelay/kvrelay/xds"
)

// At most maxScopes scope caches exist: a proxy of one more scope watches the full cache
// (and is counted), a scope's cache stays while watched and for scopeIdle after, and then
// gives its place to another. A watch's cancel counts once however often it is called.
func TestScopesAreBounded(t *testing.T) {
	c := newScopedWorkers()
	now := time.Unix(1000, 0)
	c.now = func() time.Time { return now }
	changed := map[string]types.Resource{}
	for i := range maxScopes + 1 {
		w := xds.NewWorker(fmt.Sprintf("w%03d", i), "http://10.0.0.1:8000", fmt.Sprintf("m%03d", i))
		changed[w.GetId()] = w
	}
	if err := c.update(changed, nil); err != nil {
		t.Fatal(err)
	}
	watch := func(model string) (func(), chan cache.DeltaResponse) {
		t.Helper()
		n := &core.Node{Id: "p-" + model}
		xds.SetNodeModels(n, []string{model})
		req := &cache.DeltaRequest{Node: n, TypeUrl: xds.WorkerType, ResourceNamesSubscribe: []string{"*"}}
		sub := stream.NewDeltaSubscription([]string{"*"}, nil, nil, true)
		ch := make(chan cache.DeltaResponse, 1)
		cancel, err := c.CreateDeltaWatch(req, sub, ch)
		if err != nil {
			t.Fatal(err)
		}
		return cancel, ch
	}
	names := func(ch chan cache.DeltaResponse) int {
		t.Helper()
		select {
		case r := <-ch:
			resp, err := r.GetDeltaDiscoveryResponse()
			if err != nil {
				t.Fatal(err)
			}
			return len(resp.GetResources())
		case <-time.After(5 * time.Second):
			t.Fatal("no response")
			return 0
		}
	}
	var cancels []func()
	for i := range maxScopes {
		cancel, ch := watch(fmt.Sprintf("m%03d", i))
		if n := names(ch); n != 1 {
			t.Fatalf("scope m%03d sent %d workers, want its 1", i, n)
		}
		cancels = append(cancels, cancel)
	}
	_, ch := watch(fmt.Sprintf("m%03d", maxScopes))
	if n := names(ch); n != maxScopes+1 {
		t.Fatalf("one scope too many sent %d workers, want the full cache's %d", n, maxScopes+1)
	}
	if s, over := c.stats(); s != maxScopes || over != 1 {
		t.Fatalf("%d scopes, %d unscoped watches; want %d, 1", s, over, maxScopes)
	}

	// m000's watch ends (its cancel called twice, as the delta server may); m001 holds a
	// second watch that ends once: m001 stays watched.
	cancels[0]()
	cancels[0]()
	second, _ := watch("m001")
	second()
	now = now.Add(scopeIdle - time.Second)
	if _, ch := watch(fmt.Sprintf("m%03d", maxScopes)); names(ch) != maxScopes+1 {
		t.Fatal("a scope was dropped before scopeIdle")
	}
	now = now.Add(time.Second)
	_, ch = watch(fmt.Sprintf("m%03d", maxScopes))
	if n := names(ch); n != 1 {
		t.Fatalf("after m000's idle time the new scope sent %d workers, want 1", n)
	}
	c.mu.Lock()
	_, m000 := c.scopes["m000"]
	w1 := c.scopes["m001"].watches
	c.mu.Unlock()
	if m000 || w1 != 1 {
		t.Fatalf("m000 held %v (want dropped), m001's watches %d (want 1)", m000, w1)
	}
}
