package registry

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// testArmShare is a replica's arms share as the control plane writes it (controlplane's
// armShare), with the number of the write first, so that every write differs from the
// first byte on.
type testArmShare struct {
	Write int                        `json:"write"`
	At    time.Time                  `json:"at"`
	Nodes map[string][]xdsserver.Arm `json:"nodes"`
}

// testArms is the arms of proxies proxies in a rollout, by node id: a stable arm and a
// candidate each, with the buckets the proxies report, and groups of their conversation
// groups (64 once a proxy has served a few hundred requests of each arm).
func testArms(rng *rand.Rand, proxies, groups int) map[string][]xdsserver.Arm {
	spread := func(total uint64, n int) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = uint64(rng.ExpFloat64() * float64(total) / float64(n))
		}
		return out
	}
	arm := func(version, n uint64) xdsserver.Arm {
		a := xdsserver.Arm{Version: version, Requests: n, Errors: n / 50, CachedBlocks: n * 40, PromptBlocks: n * 90,
			TTFTBounds: []float64{0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96}, TTFTCounts: spread(n, 15),
			ITLBounds: []float64{0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024}, ITLCounts: spread(n*300, 12),
			HitBounds: []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99}, HitCounts: spread(n, 12),
			Shadow:     xdsserver.Shadow{Picks: n / 10, Disagreements: n / 40, StableOverlapBlocks: n * 3, CandOverlapBlocks: n * 4, StableLoad: n * 7, CandLoad: n * 6},
			Rejections: n / 100, ServerErrors: n / 200, Decisions: n, RegretBlocks: n * 2, RouterErrors: n / 300, ClientErrors: n / 400, ClientGone: n / 500}
		for g := range groups {
			m := n / uint64(groups)
			a.Groups = append(a.Groups, xdsserver.ArmGroup{Group: uint32(g), Requests: m + rng.Uint64N(100),
				RouterErrors: rng.Uint64N(5), ClientErrors: rng.Uint64N(5), ClientGone: rng.Uint64N(3),
				CachedBlocks: m*40 + rng.Uint64N(1000), PromptBlocks: m*90 + rng.Uint64N(1000),
				TTFTCounts: spread(m, 15), ITLCounts: spread(m*300, 12)})
		}
		return a
	}
	nodes := map[string][]xdsserver.Arm{}
	for len(nodes) < proxies {
		nodes[fmt.Sprintf("r1-kvrelay-proxy-7d9f8c6b5-%05x", rng.IntN(1<<20))] = []xdsserver.Arm{arm(41, 200_000+rng.Uint64N(1000)), arm(42, 20_000+rng.Uint64N(100))}
	}
	return nodes
}

func armShareJSON(t *testing.T, write int, nodes map[string][]xdsserver.Arm) []byte {
	t.Helper()
	b, err := json.Marshal(testArmShare{Write: write, At: time.Now(), Nodes: nodes})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// shareObjects is the KvrelayShares of what of the control plane named store.
func shareObjects(t *testing.T, dyn dynamic.Interface, store, what string) []unstructured.Unstructured {
	t.Helper()
	l, err := dyn.Resource(ShareResource).Namespace("kvrelay").List(t.Context(), metav1.ListOptions{LabelSelector: ShareLabel + "=" + what + "," + StoreLabel + "=" + store})
	if err != nil {
		t.Fatal(err)
	}
	return l.Items
}

// TestKubeShares: a replica's share larger than an object holds is compressed and split,
// read back whole, and never read as parts of two writes.
func TestKubeShares(t *testing.T) {
	dyn := kubeStoreEnv(t)
	t.Run("2000 proxies", func(t *testing.T) {
		// 2,000 proxies' arms go to the API server compressed, in parts below its limits,
		// and come back whole; shrunk to 10 proxies' they take one object, and no part of the
		// larger write is left. Their arms have no conversation groups (a proxy's figures
		// early in a rollout); busy proxies' take a part per 40 proxies.
		s := openKube(t, dyn, "big")
		defer s.Close()
		s.SetShareOwner("cp-0", "0b6c4bb5-6a10-4d9a-9e3e-5d0b1c2a3f40")
		rng := rand.New(rand.NewPCG(1, 2))
		big := armShareJSON(t, 1, testArms(rng, 2000, 0))
		if err := s.PutShare("arms", "cp-0", big); err != nil {
			t.Fatal(err)
		}
		got, err := s.Shares(t.Context(), "arms")
		if err != nil || len(got) != 1 || !bytes.Equal(got["cp-0"], big) {
			t.Fatalf("Shares = %d shares (cp-0's %d bytes), %v; want cp-0's %d bytes", len(got), len(got["cp-0"]), err, len(big))
		}
		objs := shareObjects(t, dyn, "big", "arms")
		stored, escaped := 0, len(mustJSON(t, string(big)))
		for _, u := range objs {
			d, _, _ := unstructured.NestedString(u.Object, "spec", "data")
			if len(d) > sharePartBytes {
				t.Errorf("%s holds %d bytes of data, more than %d", u.GetName(), len(d), sharePartBytes)
			}
			if refs := u.GetOwnerReferences(); len(refs) != 1 || refs[0].Name != "cp-0" {
				t.Errorf("%s owned by %+v, want pod cp-0", u.GetName(), refs)
			}
			stored += len(d)
		}
		t.Logf("2,000 proxies' arms: %d bytes of JSON (%d B/proxy; %d B/proxy as one JSON string), stored as %d bytes in %d KvrelayShares (%d B/proxy, x%.1f smaller)",
			len(big), len(big)/2000, escaped/2000, stored, len(objs), stored/2000, float64(len(big))/float64(stored))
		if want := (stored + sharePartBytes - 1) / sharePartBytes; len(objs) != want || want < 2 {
			t.Fatalf("%d KvrelayShares, want %d", len(objs), want)
		}

		busy := armShareJSON(t, 1, testArms(rng, 100, 64))
		enc, _ := encodeShare(busy)
		t.Logf("busy proxies' arms (64 conversation groups each): %d B/proxy of JSON, %d B/proxy stored (x%.1f smaller)",
			len(busy)/100, len(enc)/100, float64(len(busy))/float64(len(enc)))

		small := armShareJSON(t, 2, testArms(rng, 10, 0))
		if err := s.PutShare("arms", "cp-0", small); err != nil {
			t.Fatal(err)
		}
		if objs := shareObjects(t, dyn, "big", "arms"); len(objs) != 1 || objs[0].GetName() != s.shareName("arms", "cp-0") {
			t.Fatalf("%d KvrelayShares after the share shrank, want its head alone", len(objs))
		}
		got, err = s.Shares(t.Context(), "arms")
		if err != nil || len(got) != 1 || !bytes.Equal(got["cp-0"], small) {
			t.Fatalf("Shares after the share shrank = %d shares (cp-0's %d bytes), %v; want cp-0's %d bytes", len(got), len(got["cp-0"]), err, len(small))
		}
	})
	t.Run("stray parts", func(t *testing.T) {
		// Parts that a write left (its writer went before deleting them) are not read, and
		// the next write deletes them, even from another process of the same replica.
		s := openKube(t, dyn, "stray")
		defer s.Close()
		if err := s.PutShare("arms", "cp-0", []byte(`{"v":1}`)); err != nil {
			t.Fatal(err)
		}
		head := s.shareName("arms", "cp-0")
		for i, write := range []string{"old", ""} {
			u := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "kvrelay.io/v1alpha1", "kind": "KvrelayShare",
				"metadata": map[string]any{"name": head + ".x" + strconv.Itoa(i) + "-1", "namespace": "kvrelay"},
				"spec":     map[string]any{"replica": "cp-0", "what": "arms", "write": write, "part": int64(1), "data": "garbage"}}}
			u.SetLabels(map[string]string{StoreLabel: "stray", ShareLabel: "arms", shareOfLabel: shareOf(head), shareWriteLabel: "x" + strconv.Itoa(i)})
			if _, err := dyn.Resource(ShareResource).Namespace("kvrelay").Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		got, err := s.Shares(t.Context(), "arms")
		if err != nil || len(got) != 1 || string(got["cp-0"]) != `{"v":1}` {
			t.Fatalf("Shares with stray parts = %q, %v; want cp-0's", got, err)
		}
		next := openKube(t, dyn, "stray")
		defer next.Close()
		if err := next.PutShare("arms", "cp-0", []byte(`{"v":2}`)); err != nil {
			t.Fatal(err)
		}
		if objs := shareObjects(t, dyn, "stray", "arms"); len(objs) != 1 {
			t.Fatalf("%d KvrelayShares after a new process wrote the share, want its head alone", len(objs))
		}
	})
	t.Run("reader racing a writer", func(t *testing.T) {
		// One replica rewrites a share of several parts while others list the shares: each
		// read is one write whole, never parts of two. Parts of 4 KiB make many writes of
		// several parts cheap.
		defer func(n int) { sharePartBytes = n }(sharePartBytes)
		sharePartBytes = 4 << 10
		s := openKube(t, dyn, "race")
		defer s.Close()
		rng := rand.New(rand.NewPCG(3, 4))
		if err := s.PutShare("arms", "cp-1", []byte(`{"v":1}`)); err != nil {
			t.Fatal(err)
		}
		var (
			mu      sync.Mutex
			written = map[int][sha256.Size]byte{}
			writes  atomic.Int64
			done    = make(chan struct{})
			wg      sync.WaitGroup
		)
		put := func(n int) {
			b := armShareJSON(t, n, testArms(rng, 30, 0))
			mu.Lock()
			written[n] = sha256.Sum256(b)
			mu.Unlock()
			if err := s.PutShare("arms", "cp-0", b); err != nil {
				t.Error(err)
			}
			writes.Add(1)
		}
		put(0)
		if objs := shareObjects(t, dyn, "race", "arms"); len(objs) < 3 {
			t.Fatalf("%d KvrelayShares: the share is not split", len(objs))
		}
		wg.Go(func() {
			for n := 1; ; n++ {
				select {
				case <-done:
					return
				default:
				}
				put(n)
			}
		})
		stop := sync.OnceFunc(func() {
			close(done)
			wg.Wait()
		})
		defer stop()
		var reads, seen int
		last := -1
		deadline := time.Now().Add(3 * time.Second)
		for time.Now().Before(deadline) || writes.Load() < 20 {
			got, err := s.Shares(t.Context(), "arms")
			if err != nil {
				t.Fatal(err)
			}
			if string(got["cp-1"]) != `{"v":1}` {
				t.Fatalf("cp-1's share read as %q", got["cp-1"])
			}
			b, ok := got["cp-0"]
			if !ok {
				t.Fatal("cp-0's share not read while it was being rewritten")
			}
			var sh testArmShare
			if err := json.Unmarshal(b, &sh); err != nil {
				t.Fatalf("cp-0's share read as %d bytes that are no write: %v", len(b), err)
			}
			mu.Lock()
			want, ok := written[sh.Write]
			mu.Unlock()
			if !ok || sha256.Sum256(b) != want {
				t.Fatalf("cp-0's share read as write %d mixed with others", sh.Write)
			}
			if sh.Write < last {
				t.Fatalf("read write %d after write %d", sh.Write, last)
			}
			if sh.Write != last {
				seen++
			}
			last = sh.Write
			reads++
		}
		stop()
		t.Logf("%d reads of %d writes saw %d of them", reads, writes.Load(), seen)
		if seen < 10 {
			t.Fatalf("the reads saw %d writes, want them to race several", seen)
		}
		if objs := shareObjects(t, dyn, "race", "arms"); len(objs) > 1+4 {
			t.Fatalf("%d KvrelayShares after the writes, want cp-1's and cp-0's latest", len(objs))
		}
	})
	t.Run("written whole", func(t *testing.T) {
		// A share written by a control plane that did not split shares (one object, plain
		// JSON) is read, beside one that is; writing it afresh replaces it.
		s := openKube(t, dyn, "whole")
		defer s.Close()
		old := `{"at":"2025-01-01T00:00:00Z","nodes":{"p-1":[{"Version":3,"Requests":10}]}}`
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "kvrelay.io/v1alpha1", "kind": "KvrelayShare",
			"metadata": map[string]any{"name": s.shareName("arms", "cp-0"), "namespace": "kvrelay",
				"labels": map[string]any{StoreLabel: "whole", ShareLabel: "arms"}},
			"spec": map[string]any{"replica": "cp-0", "what": "arms", "data": old}}}
		if _, err := dyn.Resource(ShareResource).Namespace("kvrelay").Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		big := armShareJSON(t, 1, testArms(rand.New(rand.NewPCG(5, 6)), 60, 0))
		if err := s.PutShare("arms", "cp-1", big); err != nil {
			t.Fatal(err)
		}
		got, err := s.Shares(t.Context(), "arms")
		if err != nil || len(got) != 2 || string(got["cp-0"]) != old || !bytes.Equal(got["cp-1"], big) {
			t.Fatalf("Shares = %d shares (cp-0's %q), %v; want cp-0's written whole and cp-1's", len(got), got["cp-0"], err)
		}
		if err := s.PutShare("arms", "cp-0", big); err != nil {
			t.Fatal(err)
		}
		got, err = s.Shares(t.Context(), "arms")
		if err != nil || len(got) != 2 || !bytes.Equal(got["cp-0"], big) {
			t.Fatalf("Shares after cp-0's rewrite: %d shares, %v", len(got), err)
		}
	})
	t.Run("CRD without parts", func(t *testing.T) {
		// Under a KvrelayShare CRD from before split shares (Helm leaves crds/ as they were
		// on an upgrade), which prunes their fields, shares are written whole, as before.
		crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
		var served map[string]any // the spec's fields as the chart defines them
		setFields := func(drop bool) {
			t.Helper()
			crd, err := crds.Get(t.Context(), "kvrelayshares.kvrelay.io", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
			v := versions[0].(map[string]any)
			path := []string{"schema", "openAPIV3Schema", "properties", "spec", "properties"}
			props, _, _ := unstructured.NestedMap(v, path...)
			if drop {
				served = props
				props = map[string]any{}
				for _, f := range []string{"replica", "what", "data"} {
					props[f] = served[f]
				}
			} else {
				props = served
			}
			if err := unstructured.SetNestedMap(v, props, path...); err != nil {
				t.Fatal(err)
			}
			if err := unstructured.SetNestedSlice(crd.Object, versions, "spec", "versions"); err != nil {
				t.Fatal(err)
			}
			if _, err := crds.Update(t.Context(), crd, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
			// Until the API server serves the schema: parts kept or not.
			probe := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "kvrelay.io/v1alpha1", "kind": "KvrelayShare",
				"metadata": map[string]any{"name": "probe", "namespace": "kvrelay"},
				"spec":     map[string]any{"replica": "probe", "what": "probe", "parts": int64(1)}}}
			eventually(t, "the CRD served", func() bool {
				got, err := dyn.Resource(ShareResource).Namespace("kvrelay").Create(t.Context(), probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
				if err != nil {
					return false
				}
				_, kept, _ := unstructured.NestedInt64(got.Object, "spec", "parts")
				return kept != drop
			})
		}
		setFields(true)
		// Parts of 1 KiB: the first write, split, learns that the CRD prunes the parts.
		defer func(n int) { sharePartBytes = n }(sharePartBytes)
		sharePartBytes = 1 << 10
		s := openKube(t, dyn, "oldcrd")
		defer s.Close()
		rng := rand.New(rand.NewPCG(7, 8))
		for n := range 2 {
			data := armShareJSON(t, n, testArms(rng, 5, 0))
			if err := s.PutShare("arms", "cp-0", data); err != nil {
				t.Fatal(err)
			}
			got, err := s.Shares(t.Context(), "arms")
			if err != nil || !bytes.Equal(got["cp-0"], data) {
				t.Fatalf("Shares under the old CRD: cp-0's %d bytes, %v; want %d", len(got["cp-0"]), err, len(data))
			}
			objs := shareObjects(t, dyn, "oldcrd", "arms")
			if len(objs) != 1 {
				t.Fatalf("%d KvrelayShares under the old CRD, want one holding the share whole", len(objs))
			}
			if d, _, _ := unstructured.NestedString(objs[0].Object, "spec", "data"); d != string(data) {
				t.Fatalf("the KvrelayShare under the old CRD holds %.40q, want the share whole", d)
			}
		}
		setFields(false)
		// Once the CRD keeps them, the next write after the recheck is split again.
		s.mu.Lock()
		s.wholeSharesSince = time.Now().Add(-wholeSharesRecheck)
		s.mu.Unlock()
		data := armShareJSON(t, 2, testArms(rng, 5, 0))
		if err := s.PutShare("arms", "cp-0", data); err != nil {
			t.Fatal(err)
		}
		if got, err := s.Shares(t.Context(), "arms"); err != nil || !bytes.Equal(got["cp-0"], data) {
			t.Fatalf("Shares under the CRD restored: cp-0's %d bytes, %v; want %d", len(got["cp-0"]), err, len(data))
		}
		if objs := shareObjects(t, dyn, "oldcrd", "arms"); len(objs) < 2 {
			t.Fatalf("%d KvrelayShares under the CRD restored, want the share split", len(objs))
		}
	})
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
