//go:build linux

package controlplane_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
)

// leaderThen starts the replica cp-0 with leadOpts and, once it leads and takes changes,
// one more replica (cp-1, cp-2…) for each of followOpts, with those options; it returns them
// once each follower knows cp-0 leads.
func leaderThen(t *testing.T, leadOpts func(*controlplane.Options), followOpts ...func(*controlplane.Options)) (lead haReplica, follow []haReplica) {
	t.Helper()
	const lease = 3 * time.Second
	h := newHAEnv(t, lease)
	lead = h.start("cp-0", leadOpts)
	deadline := time.Now().Add(2 * lease)
	for !lead.e.Leading() || !lead.c.cp.Acting() {
		if time.Now().After(deadline) {
			t.Fatal("cp-0, alone, does not lead")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for i, opts := range followOpts {
		follow = append(follow, h.start("cp-"+strconv.Itoa(i+1), opts))
	}
	for _, f := range follow {
		for f.e.Leader() != "cp-0" || f.e.Leading() {
			if time.Now().After(deadline) {
				t.Fatalf("%s does not follow cp-0 (leader %q)", f.e.Identity(), f.e.Leader())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return lead, follow
}

// waitShared waits until the replicas ids have shared their operator API's address, as a
// follower reads it.
func waitShared(t *testing.T, r haReplica, ids ...string) map[string]string {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		shares, err := r.st.Shares(t.Context(), "api")
		if err != nil {
			t.Fatal(err)
		}
		if slices.ContainsFunc(ids, func(id string) bool { _, ok := shares[id]; return !ok }) {
			if time.Now().After(deadline) {
				t.Fatalf("operator API addresses shared: %q, want those of %v", shares, ids)
			}
			time.Sleep(20 * time.Millisecond)
			continue
		}
		out := map[string]string{}
		for id, b := range shares {
			out[id] = string(b)
		}
		return out
	}
}

// apiError is the operator API's JSON error.
type apiError struct {
	Error *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func (e *apiError) String() string { return fmt.Sprintf("%s: %s", e.Error.Code, e.Error.Message) }

// sendChange sends a policy change with the token to r and returns its status and error body
// (nil when the answer is not one), failing the test when no answer comes within 15 s (a
// follower that hangs on the leader) or the answer is not JSON.
func sendChange(t *testing.T, r haReplica, policy string) (int, *apiError, time.Duration) {
	t.Helper()
	req, _ := http.NewRequest("PUT", "http://"+r.c.cp.APIAddr()+"/v1/policy", strings.NewReader(`{"policy": "`+policy+`"}`))
	req.Header.Set("Authorization", "Bearer secret")
	req.Header.Set("Content-Type", "application/json")
	client := &http.Client{Timeout: 15 * time.Second}
	start := time.Now()
	resp, err := client.Do(req)
	took := time.Since(start)
	if err != nil {
		t.Fatalf("a change sent to %s: no answer after %s: %v", r.e.Identity(), took.Round(time.Millisecond), err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("a change sent to %s: %s answered as %q: %s", r.e.Identity(), resp.Status, ct, body)
	}
	var e apiError
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("a change sent to %s: %s answered %q: %v", r.e.Identity(), resp.Status, body, err)
	}
	if e.Error == nil {
		return resp.StatusCode, nil, took
	}
	if strings.Contains(string(body), "secret") {
		t.Errorf("%s's error shows the caller's token: %s", r.e.Identity(), body)
	}
	return resp.StatusCode, &e, took
}

// replicaMetric is the value of the sample name (with its labels, as exposed) on r's /metrics.
func replicaMetric(t *testing.T, r haReplica, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + r.c.cp.APIAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("%s's /metrics has no %s", r.e.Identity(), name)
	return 0
}

const (
	forwardedMetric = "kvrelay_controlplane_api_forwarded_total"
	notLeaderMetric = `kvrelay_controlplane_api_rejected_total{reason="not_leader"}`
)

// wantError fails the test unless a change was answered status with an error of code whose
// message holds each of parts, within took.
func wantError(t *testing.T, what string, status, gotStatus int, e *apiError, took, within time.Duration, code string, parts ...string) {
	t.Helper()
	if e == nil {
		t.Fatalf("%s: %d without an error, want %d with the error code %q", what, gotStatus, status, code)
	}
	if gotStatus != status || e.Error.Code != code {
		t.Fatalf("%s: %d %q %q, want %d with the error code %q", what, gotStatus, e.Error.Code, e.Error.Message, status, code)
	}
	for _, p := range parts {
		if !strings.Contains(e.Error.Message, p) {
			t.Errorf("%s: the message %q does not say %q", what, e.Error.Message, p)
		}
	}
	if took > within {
		t.Errorf("%s: answered after %s, want within %s", what, took.Round(time.Millisecond), within)
	}
	t.Logf("%s: %d %q after %s", what, gotStatus, e.Error.Message, took.Round(time.Millisecond))
}

// TestFollowerWithoutLeaderAddress: the leader listens on every interface without
// --api-advertise, so it shares no address. A follower answers a change with 503 naming the
// leader, counts it as not_leader, and forwards nothing.
func TestFollowerWithoutLeaderAddress(t *testing.T) {
	_, follow := leaderThen(t, func(o *controlplane.Options) { o.APIListen = ":0" }, nil)
	f := follow[0]
	// The follower shared its own address (it listens on loopback); the leader, started
	// first, none.
	if shared := waitShared(t, f, "cp-1"); shared["cp-0"] != "" {
		t.Fatalf("the leader shared %s", shared["cp-0"])
	}
	code, e, took := sendChange(t, f, "round-robin")
	wantError(t, "a change sent to the follower", http.StatusServiceUnavailable, code, e, took, 5*time.Second,
		"unavailable", "cp-1 follows cp-0")
	if n := replicaMetric(t, f, forwardedMetric); n != 0 {
		t.Errorf("the follower counts %v forwarded, want 0", n)
	}
	if n := replicaMetric(t, f, notLeaderMetric); n != 1 {
		t.Errorf("the follower counts %v not_leader refusals, want 1", n)
	}
}
