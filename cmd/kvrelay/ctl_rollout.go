package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// ctlRolloutCmd is `kvrelay ctl policy rollout`: a candidate policy beside the stable one,
// routing a share of the requests (or none, in shadow) until it is promoted or aborted.
func ctlRolloutCmd(o *ctlOptions) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rollout",
		Short: "Try a candidate routing policy on a share of the requests, then promote or abort it",
		Long: `rollout puts a candidate policy beside the stable one. Proxies route the candidate's share
of the requests with it, each session (or prompt) always with the same policy, and measure
both under their versions (kvrelay_proxy_policy_ttft_seconds{policy_version}, ...); in
shadow they route every request with the stable policy and record the candidate's picks.`,
	}
	var (
		file   string
		share  float64
		shadow bool
	)
	start := &cobra.Command{
		Use:   "start --candidate-file FILE",
		Short: "Start a rollout: the candidate is the stable policy with the fields FILE sets",
		Example: `  kvrelay ctl policy rollout start --candidate-file candidate.yaml --share 0.05
  # candidate.yaml, in the form ctl policy -o json prints:  overlap_weight: 0`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			data, err := os.ReadFile(file)
			if err != nil {
				return fmt.Errorf("reading --candidate-file: %w", err)
			}
			return ctlUpdatePolicy(cmd, o, func(p *operatorv1.Policy) error {
				cand, err := candidateFrom(p, data)
				if err != nil {
					return fmt.Errorf("--candidate-file %s: %w", file, err)
				}
				p.Candidate, p.CandidateShare, p.Shadow = cand, share, shadow
				return nil
			})
		},
	}
	start.Flags().StringVar(&file, "candidate-file", "", "YAML or JSON file of the candidate's fields that differ from the stable policy (a whole policy will do)")
	start.Flags().Float64Var(&share, "share", 0, "share of the requests the candidate routes, in [0, 1]")
	start.Flags().BoolVar(&shadow, "shadow", false, "route every request with the stable policy and only record the candidate's picks")
	_ = start.MarkFlagRequired("candidate-file")
	set := &cobra.Command{
		Use:   "set",
		Short: "Change the running rollout's share or shadow",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return ctlUpdatePolicy(cmd, o, func(p *operatorv1.Policy) error {
				if p.Candidate == nil {
					return fmt.Errorf("no rollout is running (ctl policy rollout start)")
				}
				if cmd.Flags().Changed("share") {
					p.CandidateShare = share
				}
				if cmd.Flags().Changed("shadow") {
					p.Shadow = shadow
				}
				return nil
			})
		},
	}
	set.Flags().Float64Var(&share, "share", 0, "share of the requests the candidate routes, in [0, 1]")
	set.Flags().BoolVar(&shadow, "shadow", false, "route every request with the stable policy and only record the candidate's picks")
	promote := &cobra.Command{
		Use:   "promote",
		Short: "End the rollout with the candidate as the stable policy, for every request",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return ctlUpdatePolicy(cmd, o, func(p *operatorv1.Policy) error {
				if p.Candidate == nil {
					return fmt.Errorf("no rollout is running")
				}
				c := p.Candidate
				proto.Reset(p)
				proto.Merge(p, c) // the registry gives it the next version
				p.Candidate, p.CandidateShare, p.Shadow = nil, 0, false
				return nil
			})
		},
	}
	abort := &cobra.Command{
		Use:   "abort",
		Short: "End the rollout: every request routes with the stable policy again",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return ctlUpdatePolicy(cmd, o, func(p *operatorv1.Policy) error {
				if p.Candidate == nil {
					return fmt.Errorf("no rollout is running")
				}
				p.Candidate, p.CandidateShare, p.Shadow = nil, 0, false
				return nil
			})
		},
	}
	cmd.AddCommand(start, set, promote, abort)
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
