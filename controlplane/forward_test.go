//go:build linux

package controlplane_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/xds/auth/authtest"
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

// TestForwardToUnreachableLeader: the leader shared an address where nothing listens (its
// operator API's listener closed). A follower answers a change sent to it at once with 502
// and the API's JSON error, naming itself, the leader and the address it tried, and counts
// the forward; nothing changes. Once the leader shares a working address, the next change
// goes through: the follower read the address afresh, not the failed one it had read.
func TestForwardToUnreachableLeader(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	l.Close()
	lead, follow := leaderThen(t, func(o *controlplane.Options) { o.APIAdvertise = closed }, nil)
	f := follow[0]
	if got := waitShared(t, f, "cp-0")["cp-0"]; !strings.Contains(got, closed) {
		t.Fatalf("cp-0 shared %s, want %s", got, closed)
	}
	_, before := lead.c.api("GET", "/v1/policy", "", true)

	for i := 1; i <= 2; i++ {
		code, e, took := sendChange(t, f, "round-robin")
		wantError(t, "a change sent to the follower", http.StatusBadGateway, code, e, took, 5*time.Second,
			"unavailable", "cp-1", "cp-0", closed, "connection refused")
		if n := replicaMetric(t, f, forwardedMetric); n != float64(i) {
			t.Errorf("after %d changes the follower counts %v forwarded", i, n)
		}
	}
	if n := replicaMetric(t, f, notLeaderMetric); n != 0 {
		t.Errorf("the follower refused %v changes as not the leader; it forwarded them", n)
	}
	// A change without the token is not forwarded: 401, and nothing of the leader told.
	if code, out := f.c.apiWith("PUT", "/v1/policy", `{"policy": "round-robin"}`, map[string]string{"Authorization": "Bearer wrong"}); code != 401 ||
		strings.Contains(fmt.Sprint(out), "cp-0") || strings.Contains(fmt.Sprint(out), closed) {
		t.Errorf("a change with a wrong token: %d %v, want 401 naming neither the leader nor its address", code, out)
	}
	if n := replicaMetric(t, f, forwardedMetric); n != 2 {
		t.Errorf("a change with a wrong token was forwarded (%v forwarded)", n)
	}
	if _, got := lead.c.api("GET", "/v1/policy", "", true); got["policy"] != before["policy"] || jsonUint(got["version"]) != jsonUint(before["version"]) {
		t.Fatalf("the policy is %v after changes that never reached the leader, was %v", got, before)
	}

	// The leader shares its listener's address (as after a restart of its operator API).
	if err := lead.st.PutShare("api", "cp-0", []byte(`{"addr": "`+lead.c.cp.APIAddr()+`"}`)); err != nil {
		t.Fatal(err)
	}
	code, e, _ := sendChange(t, f, "round-robin")
	if code != 200 || e != nil {
		t.Fatalf("a change sent to the follower once the leader shared a working address: %d %v", code, e)
	}
	if n := replicaMetric(t, f, forwardedMetric); n != 3 {
		t.Errorf("after 3 changes the follower counts %v forwarded", n)
	}
	if _, got := lead.c.api("GET", "/v1/policy", "", true); got["policy"] != "round-robin" || jsonUint(got["version"]) != jsonUint(before["version"])+1 {
		t.Fatalf("the policy is %v after the forwarded change, was %v", got, before)
	}
}

// TestForwardToSilentLeader: the leader's address takes connections and answers nothing (a
// leader that hangs). A follower does not hang with it: past its API read timeout it answers
// 504 with the API's JSON error, and drops the connection to the leader.
func TestForwardToSilentLeader(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	dropped := make(chan time.Time, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(io.Discard, c) // read the request, answer nothing
				dropped <- time.Now()
			}()
		}
	}()
	const readTimeout = time.Second
	_, follow := leaderThen(t, func(o *controlplane.Options) { o.APIAdvertise = l.Addr().String() },
		func(o *controlplane.Options) { o.APIReadTimeout = readTimeout })
	f := follow[0]
	waitShared(t, f, "cp-0")

	code, e, took := sendChange(t, f, "round-robin")
	answered := time.Now()
	wantError(t, "a change sent to the follower", http.StatusGatewayTimeout, code, e, took, readTimeout+2*time.Second,
		"deadline_exceeded", "cp-1", "cp-0", l.Addr().String())
	if took < readTimeout {
		t.Errorf("answered after %s, before the read timeout (%s)", took, readTimeout)
	}
	select {
	case at := <-dropped:
		if at.Sub(answered) > time.Second {
			t.Errorf("the connection to the leader was dropped %s after the answer", at.Sub(answered))
		}
	case <-time.After(2 * time.Second):
		t.Error("the follower kept its connection to the silent leader")
	}
	if n := replicaMetric(t, f, forwardedMetric); n != 1 {
		t.Errorf("the follower counts %v forwarded, want 1", n)
	}
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

// TestForwardChecksLeaderCertificate: the leader serves its operator API over HTTPS. A
// follower whose --api-peer-ca issued the leader's certificate forwards a change; one whose
// CA did not, and one that expects another name (--api-peer-server-name), answer 502 saying
// the certificate is why, and the change is not made.
func TestForwardChecksLeaderCertificate(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	ca, err := authtest.NewCA(dir, "operators")
	if err != nil {
		t.Fatal(err)
	}
	pair, err := ca.Issue("api", "control-plane", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := authtest.NewCA(other, "strangers")
	if err != nil {
		t.Fatal(err)
	}
	_, follow := leaderThen(t, func(o *controlplane.Options) { o.APICertFile, o.APIKeyFile = pair.CertFile, pair.KeyFile },
		func(o *controlplane.Options) { o.APIPeerCAFile = stranger.CertFile },
		func(o *controlplane.Options) { o.APIPeerCAFile, o.APIPeerServerName = ca.CertFile, "elsewhere.example" },
		func(o *controlplane.Options) { o.APIPeerCAFile = ca.CertFile })
	untrusting, misnaming, trusting := follow[0], follow[1], follow[2]
	if got := waitShared(t, trusting, "cp-0")["cp-0"]; !strings.Contains(got, `"tls":true`) {
		t.Fatalf("cp-0 shared %s, want its HTTPS address", got)
	}
	_, before := trusting.c.api("GET", "/v1/policy", "", true)

	code, e, took := sendChange(t, untrusting, "random")
	wantError(t, "a change sent to a follower that does not trust the leader's CA", http.StatusBadGateway, code, e, took, 5*time.Second,
		"unavailable", "cp-1", "cp-0", "certificate signed by unknown authority")
	code, e, took = sendChange(t, misnaming, "random")
	wantError(t, "a change sent to a follower that expects another name", http.StatusBadGateway, code, e, took, 5*time.Second,
		"unavailable", "cp-2", "cp-0", "elsewhere.example")
	for _, r := range []haReplica{untrusting, misnaming} {
		if n := replicaMetric(t, r, forwardedMetric); n != 1 {
			t.Errorf("%s counts %v forwarded, want 1", r.e.Identity(), n)
		}
	}

	code, e, _ = sendChange(t, trusting, "round-robin")
	if code != 200 || e != nil {
		t.Fatalf("a change sent to the follower that trusts the leader's CA: %d %v", code, e)
	}
	if n := replicaMetric(t, trusting, forwardedMetric); n != 1 {
		t.Errorf("%s counts %v forwarded, want 1", trusting.e.Identity(), n)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, got := trusting.c.api("GET", "/v1/policy", "", true)
		if got["policy"] == "round-robin" {
			if v := jsonUint(got["version"]); v != jsonUint(before["version"])+1 {
				t.Fatalf("the policy's version went from %d to %d: a refused change was made", jsonUint(before["version"]), v)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the forwarded change never showed: %v", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
