package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/controlplane/planner/plannertest"
	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// memRegistry is the registry as the planner sees it.
type memRegistry struct {
	mu sync.Mutex
	ws []registry.Worker
}

func (r *memRegistry) Workers() []registry.Worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]registry.Worker(nil), r.ws...)
}
func (r *memRegistry) Upsert(w registry.Worker) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ws = append(r.ws, w)
	return nil
}
func (r *memRegistry) Remove(string) error            { return nil }
func (r *memRegistry) SetDraining(string, bool) error { return nil }

// plannerProfile writes a profile where a replica prefills 10000 tokens/s within a 1 s TTFT
// and decodes 1000 tokens/s within a 50 ms ITL.
func plannerProfile(t *testing.T) string {
	t.Helper()
	p := &planner.Profile{Version: planner.ProfileVersion,
		Prefill: []planner.PrefillPoint{{ISL: 1000, Concurrency: 1, TTFTMs: 100, Throughput: 10000}},
		Decode:  []planner.DecodePoint{{Context: 1000, Concurrency: 10, ITLMs: 10, Throughput: 1000}},
	}
	path := filepath.Join(t.TempDir(), "profile.json")
	if err := p.Save(path); err != nil {
		t.Fatal(err)
	}
	return path
}

func parsePlannerFlags(t *testing.T, args ...string) *cpPlannerFlags {
	t.Helper()
	var f cpPlannerFlags
	fs := pflag.NewFlagSet("controlplane", pflag.ContinueOnError)
	f.register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return &f
}

// The control plane command has the planner's flags.
func TestControlPlanePlannerFlags(t *testing.T) {
	fs := newControlPlaneCmd().Flags()
	for _, name := range []string{"planner", "planner-actuator", "planner-deployment", "planner-namespace", "planner-profile", "planner-headroom", "planner-scale-down-window", "kubeconfig"} {
		if fs.Lookup(name) == nil {
			t.Errorf("kvrelay controlplane has no --%s", name)
		}
	}
	if got := fs.Lookup("planner-actuator").DefValue; got != actuatorKube {
		t.Errorf("--planner-actuator defaults to %q, want kube", got)
	}
}

// TestControlPlanePlannerKube: `kvrelay controlplane --planner --planner-actuator kube`
// scales the Deployment of its pool through the scale subresource (here the fake
// clientset); with dry-run it reads the Deployment's size but leaves it.
func TestControlPlanePlannerKube(t *testing.T) {
	prof := plannerProfile(t)
	for _, tc := range []struct {
		name     string
		actuator string
		want     int32
	}{{"kube scales", actuatorKube, 6}, {"dry run reads only", actuatorDryRun, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			two := int32(2)
			client := plannertest.NewKube(&appsv1.Deployment{
				ObjectMeta: metav1.ObjectMeta{Name: "vllm", Namespace: "llm"},
				Spec: appsv1.DeploymentSpec{Replicas: &two,
					Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "vllm"}}},
			})
			f := parsePlannerFlags(t, "--planner", "--planner-profile", prof, "--planner-actuator", tc.actuator,
				"--planner-deployment", "both=vllm", "--planner-namespace", "llm", "--planner-max", "6", "--planner-interval", "1m")
			env := plannerEnv{reg: &memRegistry{}, namespace: "default", log: slog.New(slog.NewTextHandler(io.Discard, nil)),
				kube: func() (kubernetes.Interface, error) { return client, nil }}
			p, closeAct, err := f.build(env)
			if err != nil {
				t.Fatal(err)
			}
			defer closeAct()
			// 30 req/s of 1000 in and 100 out: 30000/10000 + 3000/1000 = 6 replicas.
			o := planner.Observation{At: time.Unix(1000, 0), Window: time.Minute, Requests: 1800, PromptTokens: 1800 * 1000, OutputTokens: 1800 * 100}
			ds := p.Step(context.Background(), o)
			if len(ds) != 1 || ds[0].From != 2 || ds[0].To != 6 {
				t.Fatalf("decisions %+v: want one, from the Deployment's 2 to 6", ds)
			}
			d, err := client.AppsV1().Deployments("llm").Get(context.Background(), "vllm", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if want := tc.want; *d.Spec.Replicas != want || (tc.actuator == actuatorKube) != ds[0].Applied {
				t.Errorf("deployment at %d, decision %+v; want %d", *d.Spec.Replicas, ds[0], tc.want)
			}
		})
	}
}

func TestControlPlanePlannerFlagErrors(t *testing.T) {
	prof := plannerProfile(t)
	env := plannerEnv{reg: &memRegistry{}, log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		kube: func() (kubernetes.Interface, error) { return nil, errors.New("no cluster here") }}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no profile", []string{"--planner"}, "--planner-profile"},
		{"kube without deployments", []string{"--planner-profile", prof}, "--planner-deployment"},
		{"bad deployment", []string{"--planner-profile", prof, "--planner-deployment", "gpu=vllm"}, "POOL=DEPLOYMENT"},
		{"pool twice", []string{"--planner-profile", prof, "--planner-deployment", "both=a", "--planner-deployment", "both=b"}, "twice"},
		{"no cluster", []string{"--planner-profile", prof, "--planner-deployment", "both=a"}, "no cluster here"},
		{"unknown actuator", []string{"--planner-profile", prof, "--planner-actuator", "ssh"}, "kube, local or dry-run"},
		{"bad pools", []string{"--planner-profile", prof, "--planner-actuator", "dry-run", "--planner-pools", "gpu"}, "--planner-pools"},
		{"prefill alone", []string{"--planner-profile", prof, "--planner-actuator", "dry-run", "--planner-pools", "prefill"}, "pools must be"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := parsePlannerFlags(t, tc.args...)
			_, closeAct, err := f.build(env)
			_ = closeAct()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("build: %v, want an error about %q", err, tc.want)
			}
		})
	}
}

// Dry run without Deployments starts from the registry's workers, by role.
func TestControlPlanePlannerDryRunFromRegistry(t *testing.T) {
	reg := &memRegistry{ws: []registry.Worker{{ID: "p0", Role: "prefill"}, {ID: "d0", Role: "decode"}, {ID: "d1", Role: "decode"}, {ID: "d2", Role: "decode", Draining: true}}}
	f := parsePlannerFlags(t, "--planner-profile", plannerProfile(t), "--planner-actuator", "dry-run", "--planner-pools", "prefill,decode")
	p, closeAct, err := f.build(plannerEnv{reg: reg, log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer closeAct()
	ds := p.Step(context.Background(), planner.Observation{At: time.Unix(1000, 0), Window: time.Minute, Requests: 600, PromptTokens: 6e5, OutputTokens: 6e4})
	if len(ds) != 2 || ds[0].Pool != planner.PoolPrefill || ds[0].From != 1 || ds[1].From != 2 || !ds[0].DryRun || ds[0].Applied {
		t.Errorf("decisions %+v: want dry-run decisions from prefill 1, decode 2", ds)
	}
}

// --leader-elect's durations must nest (retry < renew deadline < lease), as client-go's
// elector needs; the command says so before it reads any Kubernetes configuration.
func TestLeaderFlagsRefuseBadDurations(t *testing.T) {
	for _, f := range []leaderFlags{
		{lease: 10 * time.Second, renew: 10 * time.Second, retry: time.Second},
		{lease: 15 * time.Second, renew: 10 * time.Second, retry: 10 * time.Second},
	} {
		if _, err := f.build("/nonexistent/kubeconfig", "default", nil); err == nil || !strings.Contains(err.Error(), "retry period") {
			t.Errorf("build(%+v) = %v, want the durations refused", f, err)
		}
	}
	f := leaderFlags{lease: 15 * time.Second, renew: 10 * time.Second, retry: 2 * time.Second}
	if _, err := f.build("/nonexistent/kubeconfig", "default", nil); err == nil || strings.Contains(err.Error(), "retry period") {
		t.Errorf("good durations: %v, want only the missing kubeconfig refused", err)
	}
}
