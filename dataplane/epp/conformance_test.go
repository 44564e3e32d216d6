package epp_test

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/epp"
	"github.com/kvrelay/kvrelay/internal/extprocgw"
)

// The Gateway API Inference Extension's conformance suite drives a picker through a real
// gateway with the test-epp-endpoint-selection header; these are its picker assertions,
// each reproduced through the Envoy stand-in over simulated engines (on loopback the
// engines share one IP, so the suite's IP entries are ip:port here, and its DP-rank case,
// one IP with several ports, is an IP entry):
//
//   - GatewayFollowingEPPRouting: requests naming one endpoint reach only it; naming two,
//     only those two; naming all, any of them.
//   - GatewayFollowingEPPRoutingWithDataParallelism: an IP entry spreads over that host's
//     ports.
//   - GatewayDestinationEndpointServed: the answer carries the endpoint that served it, as
//     the gateway reported it back.
//
// The suite's other tests (EppUnAvailableFailOpen, InferencePoolAccepted,
// HTTPRouteInvalidInferencePoolRef, HTTPRouteMultipleGatewaysDifferentPools,
// GatewayWeightedAcrossTwoInferencePools) test the gateway and the InferencePool's
// controller, not the picker.
func TestConformanceAssertions(t *testing.T) {
	e := newEnv(t, envOpts{workers: 3, epp: func(o *epp.Options) { o.Conformance = true }})
	base := e.gateway(t, nil)
	addrs := e.addrs()
	send := func(sel string, i int) (served, reported string) {
		t.Helper()
		req, _ := http.NewRequest("POST", base+"/v1/chat/completions", bytes.NewReader(chatBody(family(i), "conformance", 2, false)))
		req.Header.Set("content-type", "application/json")
		if sel != "" {
			req.Header.Set(epp.ConformanceSelectHeader, sel)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return resp.Header.Get(extprocgw.WorkerHeader), resp.Header.Get(epp.ConformanceServedHeader)
	}
	for _, tc := range []struct {
		name string
		sel  []string
	}{
		{"one endpoint", addrs[2:3]},
		{"two endpoints", addrs[:2]},
		{"every endpoint", addrs},
	} {
		t.Run("GatewayFollowingEPPRouting/"+tc.name, func(t *testing.T) {
			seen := map[string]bool{}
			for i := range 12 {
				served, reported := send(strings.Join(tc.sel, ","), 10+i)
				if !bytes.Contains([]byte(strings.Join(tc.sel, ",")), []byte(served)) || served == "" {
					t.Fatalf("request %d reached %s, outside %v", i, served, tc.sel)
				}
				if reported != served {
					t.Fatalf("GatewayDestinationEndpointServed: reported %q, served by %q", reported, served)
				}
				seen[served] = true
			}
			if len(tc.sel) > 1 && len(seen) < 2 {
				t.Fatalf("12 distinct prompts over %v all reached %v", tc.sel, seen)
			}
		})
	}
	t.Run("GatewayFollowingEPPRoutingWithDataParallelism", func(t *testing.T) {
		host, _, _ := net.SplitHostPort(addrs[0])
		seen := map[string]bool{}
		for i := range 12 {
			served, _ := send(host, 40+i)
			seen[served] = true
		}
		if len(seen) < 2 {
			t.Fatalf("an IP entry kept every request on %v", seen)
		}
	})
	t.Run("unknown endpoints fall back to every one", func(t *testing.T) {
		if served, _ := send("10.255.0.9", 60); served == "" {
			t.Fatal("no endpoint")
		}
	})
	waitIdle(t, e.core)
}
