package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// ctlRolloutCmd is `kvrelay ctl policy rollout`: a candidate policy tried beside the
// stable one, in shadow and then on growing shares of the requests, each step judged
// against the stable policy by the control plane, promoted or rolled back by itself.
func ctlRolloutCmd(o *ctlOptions) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rollout",
		Short: "Roll a candidate routing policy out step by step, judged against the stable one",
		Long: `rollout puts a candidate policy beside the stable one. Proxies route the candidate's share
of the conversations with it (every request of a session, user or prompt with the same
policy) and report both arms by conversation group; in shadow they route every request with
the stable policy and record the candidate's picks. The control plane judges each step on
conversation groups, not requests: TTFT p90 and p50, ITL p90, the router's error rate (5xx
and broken streams; client errors and clients that left are shown apart) and the prefix hit
rate, each failing only when worse than its bound and significant (Student's t on the
groups). A step that passes moves on; one worse than a bound but not yet beyond doubt runs
on until its figures double, up to its timeout; one that fails rolls back (or runs again,
--failure-limit); one without enough conversations by its timeout pauses for an operator
(--on-inconclusive rollback to roll back). A candidate whose router errors are unmistakable
is rolled back within seconds; the shadow step fails on picks that cache less;
a stable arm slower than before the rollout (a candidate loading the workers both arms
share) pauses it. After the last step the candidate becomes the stable policy.`,
	}
	var (
		file                   string
		shadow, stepDur, stepT time.Duration
		steps                  []float64
		minReq                 uint64
		minGroups              uint32
		ratio, itl, errDelta   float64
		drop                   float64
		alpha                  float64
		failLimit, inconLimit  uint32
		onIncon                string
	)
	start := &cobra.Command{
		Use:   "start --candidate-file FILE",
		Short: "Start a rollout: the candidate is the stable policy with the fields FILE sets",
		Example: `  kvrelay ctl policy rollout start --candidate-file candidate.yaml --shadow 5m --steps 5,25,50,100 --step-duration 2m
  # candidate.yaml, in the form ctl policy -o json prints:  overlap_weight: 0`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			data, err := os.ReadFile(file)
			if err != nil {
				return fmt.Errorf("reading --candidate-file: %w", err)
			}
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var p operatorv1.Policy
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/policy", nil, &p); err != nil {
				return err
			}
			cand, err := candidateFrom(&p, data)
			if err != nil {
				return fmt.Errorf("--candidate-file %s: %w", file, err)
			}
			spec := &operatorv1.RolloutSpec{ShadowMs: shadow.Milliseconds(), StepDurationMs: stepDur.Milliseconds(),
				StepTimeoutMs: stepT.Milliseconds(), MinRequests: minReq, MinGroups: minGroups,
				FailureLimit: failLimit, InconclusiveLimit: inconLimit, OnInconclusive: onIncon}
			for _, pct := range steps {
				if !(pct > 0 && pct <= 100) {
					return fmt.Errorf("--steps %v: each a percentage in (0, 100]", steps)
				}
				spec.Steps = append(spec.Steps, pct/100)
			}
			fs := cmd.Flags()
			for name, v := range map[string]**float64{"max-ttft-p90-ratio": &spec.MaxTtftP90Ratio, "max-itl-p90-ratio": &spec.MaxItlP90Ratio, "max-error-rate-delta": &spec.MaxErrorRateDelta,
				"max-hit-rate-drop": &spec.MaxHitRateDrop, "alpha": &spec.Alpha, "max-ttft-p50-ratio": &spec.MaxTtftP50Ratio,
				"fast-abort-alpha": &spec.FastAbortAlpha, "max-shadow-overlap-drop": &spec.MaxShadowOverlapDrop,
				"max-shadow-load-ratio": &spec.MaxShadowLoadRatio, "max-baseline-ttft-p90-ratio": &spec.MaxBaselineTtftP90Ratio} {
				if fs.Changed(name) {
					x, _ := fs.GetFloat64(name)
					*v = &x
				}
			}
			return c.rollout(cmd, http.MethodPost, "/v1/rollout", &operatorv1.StartRolloutRequest{Candidate: cand, Spec: spec})
		},
	}
	fs := start.Flags()
	fs.StringVar(&file, "candidate-file", "", "YAML or JSON file of the candidate's fields that differ from the stable policy (a whole policy will do)")
	fs.DurationVar(&shadow, "shadow", 0, "run the candidate in shadow this long first (0: no shadow step)")
	fs.Float64SliceVar(&steps, "steps", nil, "the candidate's shares of the requests, in percent, increasing (default 5,25,50,100)")
	fs.DurationVar(&stepDur, "step-duration", 0, "least time each step runs (default 2m)")
	fs.DurationVar(&stepT, "step-timeout", 0, "most time a step runs: waiting for its conversations, or running on while a figure is worse than its bound but not yet beyond doubt (default 5 step durations)")
	fs.Uint64Var(&minReq, "min-requests", 0, "least requests of each arm a step must see (default 30)")
	fs.Uint32Var(&minGroups, "min-groups", 0, "least conversation groups of each arm a step must see (default 3)")
	fs.Float64Var(&ratio, "max-ttft-p90-ratio", 1.10, "a step fails when the candidate's TTFT p90 exceeds this times the stable one's, significantly")
	fs.Float64Var(new(float64), "max-ttft-p50-ratio", 1.10, "the same for the TTFT median (0: not judged)")
	fs.Float64Var(&itl, "max-itl-p90-ratio", 1.10, "the same on the gaps between streamed tokens (0: not judged)")
	fs.Float64Var(&errDelta, "max-error-rate-delta", 0.005, "a step fails when the candidate's router error rate (5xx, broken streams) exceeds the stable one's by more than this, significantly")
	fs.Float64Var(&drop, "max-hit-rate-drop", 0.02, "a step fails when the candidate's prefix hit rate falls short of the stable one's by more than this, significantly")
	fs.Float64Var(&alpha, "alpha", 0.0005, "significance level of each figure's test in a step (one-sided; shared among the step's looks)")
	fs.Uint32Var(&failLimit, "failure-limit", 0, "failed steps run again before the rollout rolls back")
	fs.Uint32Var(&inconLimit, "inconclusive-limit", 0, "inconclusive steps run again before --on-inconclusive applies")
	fs.StringVar(&onIncon, "on-inconclusive", "", "what a step without enough conversations by its timeout does: pause (the default: an operator resumes, promotes or aborts) or rollback")
	fs.Float64Var(new(float64), "fast-abort-alpha", 1e-5, "roll back at once a candidate whose router errors have less than this chance at the stable arm's rate (0: never)")
	fs.Float64Var(new(float64), "max-shadow-overlap-drop", 0.25, "the shadow step fails when the candidate's picks cache this share fewer prompt blocks (0: not judged)")
	fs.Float64Var(new(float64), "max-shadow-load-ratio", 0, "the shadow step fails when the candidate's picks carry this times the load (0: not judged, the default: a cache-aware candidate rightly picks busier workers)")
	fs.Float64Var(new(float64), "max-baseline-ttft-p90-ratio", 1.25, "a step pauses when the stable arm's TTFT p90 exceeds this times its p90 before the rollout, significantly (0: not judged)")
	_ = start.MarkFlagRequired("candidate-file")
	status := &cobra.Command{
		Use:   "status",
		Short: "Show the running or latest rollout: its state and each step's figures per arm",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			return c.rollout(cmd, http.MethodGet, "/v1/rollout", nil)
		},
	}
	cmd.AddCommand(start, status)
	for _, a := range []struct{ name, short string }{
		{"pause", "Hold the rollout at its step (proxies keep the split)"},
		{"resume", "Continue a paused rollout, its step's clock moved by the time paused"},
		{"promote", "End the rollout now with the candidate as the stable policy"},
		{"abort", "End the rollout now: every request routes with the stable policy again"},
	} {
		cmd.AddCommand(&cobra.Command{
			Use: a.name, Short: a.short, Args: cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				c, err := o.client(cmd)
				if err != nil {
					return err
				}
				return c.rollout(cmd, http.MethodPost, "/v1/rollout/"+a.name, nil)
			},
		})
	}
	return cmd
}

// rollout calls a rollout route of the API and prints the rollout it answers.
func (c *ctlClient) rollout(cmd *cobra.Command, method, path string, body proto.Message) error {
	var r operatorv1.Rollout
	if err := c.call(cmd.Context(), method, path, body, &r); err != nil {
		return err
	}
	return c.print(&r, func(w io.Writer) { ctlRolloutTable(w, &r) })
}

// ctlRolloutTable prints a rollout: its state, then a row per judged step and one for the
// running step so far.
func ctlRolloutTable(w io.Writer, r *operatorv1.Rollout) {
	pct := func(x float64) string { return strconv.FormatFloat(100*x, 'f', 1, 64) + "%" }
	msec := func(x float64) string { return strconv.FormatFloat(1e3*x, 'f', 0, 64) + "ms" }
	fmt.Fprintf(w, "rollout %d: %s, stable version %d, candidate version %d", r.Id, r.State, r.StableVersion, r.CandidateVersion)
	switch {
	case r.Shadow:
		fmt.Fprint(w, ", in shadow")
	case r.State == "canary" || r.State == "paused":
		fmt.Fprintf(w, ", candidate share %s", pct(r.Share))
	}
	fmt.Fprintln(w)
	if r.Reason != "" {
		fmt.Fprintf(w, "reason: %s\n", r.Reason)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tSHARE\tVERDICT\tREQUESTS s/c\tGROUPS s/c\tTTFT P50 s/c\tTTFT P90 s/c\tITL P90 s/c\tROUTER ERRORS s/c\tCLIENT ERRORS s/c\tCLIENTS GONE s/c\tHIT RATE s/c\tREGRET s/c\tREASON")
	row := func(x *operatorv1.RolloutStep, verdict string) {
		name, reason := strconv.Itoa(int(x.Step)+1), x.Reason
		if x.Step < 0 {
			name = "shadow"
			if x.ShadowPicks > 0 {
				reason = fmt.Sprintf("disagreed on %s of %d picks; overlap %.1f against %.1f blocks, load %.1f against %.1f (candidate, stable)",
					pct(x.ShadowDisagreement), x.ShadowPicks, x.ShadowCandidateOverlap, x.ShadowStableOverlap, x.ShadowCandidateLoad, x.ShadowStableLoad)
			}
		}
		if x.Suspect != "" {
			reason = "running on: " + x.Suspect
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d/%d\t%d/%d\t%s/%s\t%s/%s\t%.1f/%.1fms\t%s/%s\t%s/%s\t%s/%s\t%s/%s\t%.1f/%.1f\t%s\n", name, pct(x.Share), verdict,
			x.StableRequests, x.CandidateRequests, x.StableGroups, x.CandidateGroups,
			msec(x.StableTtftP50), msec(x.CandidateTtftP50), msec(x.StableTtftP90), msec(x.CandidateTtftP90),
			1e3*x.StableItlP90, 1e3*x.CandidateItlP90, pct(x.StableRouterErrorRate), pct(x.CandidateRouterErrorRate),
			pct(x.StableClientErrorRate), pct(x.CandidateClientErrorRate), pct(x.StableClientGoneRate), pct(x.CandidateClientGoneRate),
			pct(x.StableHitRate), pct(x.CandidateHitRate), x.StableRegretBlocks, x.CandidateRegretBlocks, reason)
	}
	for _, x := range r.Steps {
		row(x, x.Verdict)
	}
	if x := r.Current; x != nil {
		row(x, "running")
	}
	tw.Flush()
	// The figures the last judged step was judged on.
	if n := len(r.Steps); n > 0 && len(r.Steps[n-1].Checks) > 0 {
		fmt.Fprintf(w, "\nstep %d judged on (stable, candidate, effect against its bound, t against its critical value):\n", r.Steps[n-1].Step+1)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "FIGURE\tSTABLE\tCANDIDATE\tEFFECT\tBOUND\tT\tCRITICAL\tFAILED")
		for _, c := range r.Steps[n-1].Checks {
			fmt.Fprintf(tw, "%s\t%.4g\t%.4g\t%.3f\t%.3f\t%.2f\t%.2f\t%v\n", c.Metric, c.Stable, c.Candidate, c.Effect, c.Bound, c.T, c.Critical, c.Failed)
		}
		tw.Flush()
	}
}

// ctlHistoryCmd is `kvrelay ctl policy history`: the policy's changes, the latest first.
func ctlHistoryCmd(o *ctlOptions) *cobra.Command {
	var limit uint32
	cmd := &cobra.Command{
		Use:   "history",
		Short: "List the routing policy's changes, the latest first, with what made each",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var h operatorv1.PolicyHistoryResponse
			if err := c.call(cmd.Context(), http.MethodGet, fmt.Sprintf("/v1/policy/history?limit=%d", limit), nil, &h); err != nil {
				return err
			}
			return c.print(&h, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "TIME\tVERSION\tPOLICY\tOVERLAP\tQUEUE\tCANDIDATE\tCAUSE")
				for _, ch := range h.Changes {
					p, cand := ch.Policy, "-"
					if c := p.GetCandidate(); c != nil {
						cand = fmt.Sprintf("v%d %s share %g", c.Version, c.Policy, p.CandidateShare)
						if p.Shadow {
							cand = fmt.Sprintf("v%d %s shadow", c.Version, c.Policy)
						}
					}
					fmt.Fprintf(tw, "%s\t%d\t%s\t%g\t%g\t%s\t%s\n", time.UnixMilli(ch.UnixMs).UTC().Format(time.RFC3339),
						p.GetVersion(), p.GetPolicy(), p.GetOverlapWeight(), p.GetQueueWeight(), cand, ch.Cause)
				}
				tw.Flush()
			})
		},
	}
	cmd.Flags().Uint32Var(&limit, "limit", 50, "most changes to list")
	return cmd
}

// candidateFrom is the stable policy p with the fields data (YAML or JSON, protobuf field
// names) sets; a zero in data is a zero. Versions and rollout fields in data are refused.
func candidateFrom(p *operatorv1.Policy, data []byte) (*operatorv1.Policy, error) {
	var overlay map[string]any
	if err := yaml.Unmarshal(data, &overlay); err != nil {
		return nil, err
	}
	for _, k := range []string{"candidate", "candidate_share", "shadow"} {
		if _, ok := overlay[k]; ok {
			return nil, fmt.Errorf("%s is not a field of a candidate", k)
		}
	}
	base, err := ctlJSON(p)
	if err != nil {
		return nil, err
	}
	var merged map[string]any
	if err := json.Unmarshal(base, &merged); err != nil {
		return nil, err
	}
	for _, k := range []string{"candidate", "candidate_share", "shadow", "version"} {
		delete(merged, k)
	}
	delete(overlay, "version")
	for k, v := range overlay {
		merged[k] = v
	}
	out, err := json.Marshal(merged)
	if err != nil {
		return nil, err
	}
	var c operatorv1.Policy
	if err := protojson.Unmarshal(out, &c); err != nil {
		return nil, err
	}
	return &c, nil
}
