package registry

import (
	"errors"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestWatchFailingIsReported: a store whose watches keep failing (here every watch call of
// the dynamic client errs) reports it once the failures have gone on for watchErrAfter, so
// that /readyz takes the replica out; a store whose watches work reports nothing.
func TestWatchFailingIsReported(t *testing.T) {
	defer func(a, g time.Duration) { watchErrAfter, watchErrGap = a, g }(watchErrAfter, watchErrGap)
	watchErrAfter, watchErrGap = 500*time.Millisecond, 5*time.Second
	kinds := map[schema.GroupVersionResource]string{
		PolicyResource: "KvrelayPolicyList", WorkerResource: "KvrelayWorkerList", RolloutResource: "KvrelayRolloutList",
		APIKeyResource: "KvrelayAPIKeyList",
	}
	healthy := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), kinds)
	ok, err := OpenKube(healthy, "kvrelay", "ok", 5*time.Second, discard())
	if err != nil {
		t.Fatal(err)
	}
	defer ok.Close()

	failing := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), kinds)
	failing.PrependWatchReactor("*", func(k8stesting.Action) (bool, watch.Interface, error) {
		return true, nil, errors.New("the API server refused the watch")
	})
	bad, err := OpenKube(failing, "kvrelay", "bad", 5*time.Second, discard())
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	deadline := time.Now().Add(20 * time.Second)
	for bad.WatchFailing() == nil {
		if time.Now().After(deadline) {
			t.Fatal("a store whose every watch fails did not report it in 20 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := ok.WatchFailing(); err != nil {
		t.Fatalf("a store whose watches work reports %v", err)
	}
}
