package controlplane

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/controlplane/api"
	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/controlplane/rollout"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// TestRolloutSpecDefaults: unset fields take the defaults, a step duration alone brings a
// step timeout of five, and what cannot work is an invalid request.
func TestRolloutSpecDefaults(t *testing.T) {
	s, err := rolloutSpec(&operatorv1.RolloutSpec{Steps: []float64{0.25, 0.5, 1}, StepDurationMs: 20000, MinRequests: 40})
	if err != nil || s.StepDuration != 20*time.Second || s.StepTimeout != 100*time.Second || s.MinRequests != 40 || s.MaxTTFTP90Ratio != 1.10 || len(s.Steps) != 3 {
		t.Fatalf("spec %+v, %v", s, err)
	}
	zero := 0.0
	if s, err = rolloutSpec(&operatorv1.RolloutSpec{MaxHitRateDrop: &zero}); err != nil || s.MaxHitRateDrop != 0 || s.StepDuration != 2*time.Minute {
		t.Fatalf("an explicit zero threshold: %+v, %v", s, err)
	}
	for _, bad := range []*operatorv1.RolloutSpec{{Steps: []float64{0.5, 0.25}}, {StepDurationMs: -1}, {StepDurationMs: 60000, StepTimeoutMs: 1000}, {Alpha: new(0.9)}} {
		if _, err := rolloutSpec(bad); !errors.Is(err, api.ErrInvalid) {
			t.Errorf("%v: %v, want invalid", bad, err)
		}
	}
}

// FuzzRolloutSpec: any spec an API body can carry is taken or refused as invalid, and a
// taken one has increasing shares in (0, 1] and finite, ordered durations.
func FuzzRolloutSpec(f *testing.F) {
	f.Add([]byte(`{"steps": [0.05, 0.25, 0.5, 1], "step_duration_ms": "120000", "min_requests": "200"}`))
	f.Add([]byte(`{"shadow_ms": "9223372036854775807", "step_timeout_ms": "1", "alpha": 0.5}`))
	f.Add([]byte(`{"steps": ["NaN"], "max_ttft_p90_ratio": "Infinity"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		var m operatorv1.RolloutSpec
		if protojson.Unmarshal(body, &m) != nil {
			return
		}
		s, err := rolloutSpec(&m)
		if err != nil {
			if !errors.Is(err, api.ErrInvalid) {
				t.Fatalf("%s: %v is not an invalid request", body, err)
			}
			return
		}
		for i, v := range s.Steps {
			if !(v > 0 && v <= 1) || i > 0 && v <= s.Steps[i-1] {
				t.Fatalf("%s: steps %v", body, s.Steps)
			}
		}
		if s.StepDuration <= 0 || s.StepTimeout < s.StepDuration || math.IsNaN(s.Alpha) {
			t.Fatalf("%s: spec %+v", body, s)
		}
	})
}

// TestProfileWireForm: a profile crosses from the operator API to the store and back, and
// to the xDS resource, unchanged: the two APIs' Profile messages keep one wire form.
func TestProfileWireForm(t *testing.T) {
	in := &operatorv1.Profile{
		Filters: []*operatorv1.Plugin{{Name: "model"}, {Name: "health"}},
		Scorers: []*operatorv1.Plugin{{Name: "prefill", Weight: 2, Params: map[string]float64{"overlap_weight": 32, "queue_weight": 4}}},
		Picker:  &operatorv1.Plugin{Name: "min-cost", Params: map[string]float64{"temperature": 0.5}},
		Spread:  &operatorv1.Plugin{Name: "least-prefill"},
	}
	p := storedPolicy(&operatorv1.Policy{Policy: "custom", Profile: in})
	if p.Profile == nil || len(p.Profile.Scorers) != 1 || p.Profile.Scorers[0].Params["queue_weight"] != 4 || p.Profile.Spread == nil {
		t.Fatalf("stored %+v", p.Profile)
	}
	if out := profileMessage(p.Profile); !proto.Equal(in, out) {
		t.Fatalf("back from the store: %v, want %v", out, in)
	}
	r := routingResource(p).GetProfile()
	if r.GetPicker().GetParams()["temperature"] != 0.5 || len(r.GetFilters()) != 2 || r.GetSpread().GetName() != "least-prefill" {
		t.Fatalf("pushed %v", r)
	}
}

// TestBadStoredRolloutFailsTheStart: a stored rollout that cannot be read (not JSON, or no
// state) stops the control plane from starting rather than resuming nothing.
func TestBadStoredRolloutFailsTheStart(t *testing.T) {
	for _, rec := range []string{`{`, `{"id": 3}`} {
		dir := t.TempDir()
		st, err := registry.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.PutRollout(3, []byte(rec)); err != nil {
			t.Fatal(err)
		}
		st.Close()
		s, err := New(Options{DataDir: dir, XDSListen: "127.0.0.1:0"})
		if err == nil {
			s.Close()
			t.Fatalf("stored rollout %s: the control plane started", rec)
		}
		if !strings.Contains(err.Error(), "stored rollout") {
			t.Fatalf("stored rollout %s: %v", rec, err)
		}
	}
}

// TestAbortFindsACandidateUnderANewVersion: a rollout whose candidate went back into the
// policy under a new version, heard of by a replica through an older record (a store read
// behind the write), still takes its candidate out of the policy when it ends.
func TestAbortFindsACandidateUnderANewVersion(t *testing.T) {
	s, err := New(Options{DataDir: t.TempDir(), XDSListen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := s.rollouts
	cand := registry.Policy{Name: "latency", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1, TierWeights: []float64{1, 0.75, 0.25}}
	spec, err := rolloutSpec(&operatorv1.RolloutSpec{ShadowMs: 600000, Steps: []float64{0.5, 1}, StepDurationMs: 600000, MinRequests: 40})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.start(cand, spec); err != nil {
		t.Fatal(err)
	}
	recorded := c.cur.Candidate.Version
	// The policy loses the candidate (a leader stopped between the rollout's write and the
	// policy's); applying the rollout puts it back under the next version.
	if _, err := s.reg.ChangePolicy(s.reg.Policy().Stable(), "test"); err != nil {
		t.Fatal(err)
	}
	if err := c.apply(c.cur); err != nil {
		t.Fatal(err)
	}
	if v := s.reg.Policy().Candidate.Version; v == recorded {
		t.Fatalf("the candidate went back in at its old version %d", v)
	}
	c.cur.Candidate.Version = recorded // the older record
	if err := c.control("abort"); err != nil {
		t.Fatal(err)
	}
	if pol := s.reg.Policy(); pol.Candidate != nil {
		t.Fatalf("after the abort the policy still carries candidate version %d", pol.Candidate.Version)
	}
}

// TestStepFiguresPerProxy: a step's figures are what each proxy served since the step
// began. A proxy that drops out and comes back adds what it served meanwhile, not its
// history from before the step; one that restarted counts from nothing; one first heard of
// in the step counts from then.
func TestStepFiguresPerProxy(t *testing.T) {
	arm := func(v, n uint64) xdsserver.Arm {
		return xdsserver.Arm{Version: v, Requests: n, RouterErrors: n / 10,
			Groups: []xdsserver.ArmGroup{{Group: uint32(n % 7), Requests: n, RouterErrors: n / 10}}}
	}
	r, err := rollout.New(rollout.DefaultSpec(), time.Unix(1_800_000_000, 0), rollout.Arm{}, rollout.Arm{})
	if err != nil {
		t.Fatal(err)
	}
	rec := &rolloutRecord{ID: 1, StableVersion: 1, Candidate: registry.Policy{Version: 2}, R: r}
	c := &rollouts{}
	nodes := map[string][]xdsserver.Arm{"a": {arm(1, 1000), arm(2, 100)}, "b": {arm(1, 5000), arm(2, 500)}}
	r.BaseStable, r.BaseCandidate = armOf(xdsserver.SumArms(nodes), 1), armOf(xdsserver.SumArms(nodes), 2)
	c.bases = newStepBases(rec, nodes)
	step := func(nodes map[string][]xdsserver.Arm) (uint64, uint64) {
		st, ca := c.stepArms(rec, nodes)
		return st.Sub(r.BaseStable).Requests, ca.Sub(r.BaseCandidate).Requests
	}
	if s, k := step(map[string][]xdsserver.Arm{"a": {arm(1, 1100), arm(2, 110)}, "b": {arm(1, 5200), arm(2, 520)}}); s != 300 || k != 30 {
		t.Fatalf("both proxies: %d stable, %d candidate requests in the step; want 300, 30", s, k)
	}
	// b drops out: its figures stop counting, a's go on.
	if s, k := step(map[string][]xdsserver.Arm{"a": {arm(1, 1200), arm(2, 120)}}); s != 200 || k != 20 {
		t.Fatalf("b away: %d, %d; want 200, 20", s, k)
	}
	// b returns having served 400 more: those count, its 5000 from before the step do not.
	if s, k := step(map[string][]xdsserver.Arm{"a": {arm(1, 1200), arm(2, 120)}, "b": {arm(1, 5400), arm(2, 540)}}); s != 600 || k != 60 {
		t.Fatalf("b back: %d, %d; want 600, 60", s, k)
	}
	// a restarts (its figures fall to 50): its 50 since count; c is new with 9000: from now.
	if s, k := step(map[string][]xdsserver.Arm{"a": {arm(1, 50), arm(2, 5)}, "b": {arm(1, 5400), arm(2, 540)}, "c": {arm(1, 9000), arm(2, 900)}}); s != 450 || k != 45 {
		t.Fatalf("a restarted, c new: %d, %d; want 450, 45", s, k)
	}
	if s, k := step(map[string][]xdsserver.Arm{"a": {arm(1, 60), arm(2, 6)}, "b": {arm(1, 5400), arm(2, 540)}, "c": {arm(1, 9100), arm(2, 910)}}); s != 560 || k != 56 {
		t.Fatalf("later: %d, %d; want 560, 56", s, k)
	}
}

// TestAPITokenIsReadAgain: the operator API's token comes from its file, read again after
// tokenReread: a rotated token takes effect without a restart; a file that turns empty or
// unreadable leaves the token in force.
func TestAPITokenIsReadAgain(t *testing.T) {
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte("first\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := New(Options{XDSListen: "127.0.0.1:0", DataDir: t.TempDir(), APIToken: "first", APITokenFile: file})
	if err != nil {
		t.Fatal(err)
	}
	if got := s.apiToken(); got != "first" {
		t.Fatalf("token %q, want first", got)
	}
	reread := func(content string) string {
		if content == "<gone>" {
			_ = os.Remove(file)
		} else if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		s.apiTok.mu.Lock()
		s.apiTok.read = time.Time{} // as if tokenReread had passed
		s.apiTok.mu.Unlock()
		return s.apiToken()
	}
	if got := reread("second\n"); got != "second" {
		t.Fatalf("after the rotation: %q, want second", got)
	}
	if got := reread("  \n"); got != "second" {
		t.Fatalf("an empty file: %q, want the token in force", got)
	}
	if got := reread("<gone>"); got != "second" {
		t.Fatalf("no file: %q, want the token in force", got)
	}
	if err := os.WriteFile(file, []byte("third"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := s.apiToken(); got != "second" {
		t.Fatalf("read again before tokenReread: %q", got)
	}
}
