package main

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrelay/kvrelay/controlplane/planner"
)

func newProfileCmd() *cobra.Command {
	cfg := planner.DefaultMeasureConfig()
	var out string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "profile",
		Short: "Measure a worker's TTFT, ITL and throughputs for the planner",
		Long: `profile measures one worker through its OpenAI API (the simulated engine or any
OpenAI-compatible engine): TTFT and prompt tokens/s against input length and concurrency
(--isl, --prefill-concurrency; max_tokens 1), and inter-token latency and output tokens/s
against context length and concurrent streams (--context, --decode-concurrency; --osl tokens
each, ignore_eos). Prompts are random words, unique per request, their length calibrated
with the engine's own token counts. It writes the profile the planner loads
(kvrelay up --planner --planner-profile FILE) as JSON to --out. Measure a worker that serves
nothing else.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel func()
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			cfg.Progress = cmd.ErrOrStderr()
			p, err := planner.Measure(ctx, cfg)
			if err != nil {
				return err
			}
			if err := p.Save(out); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "profile of %s (%s, role %s): %d prefill and %d decode points written to %s\n",
				cfg.Target, p.Model, p.Role, len(p.Prefill), len(p.Decode), out)
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&cfg.Target, "target", "http://127.0.0.1:8001/v1", "the worker's OpenAI base URL")
	fs.StringVar(&cfg.Role, "role", "both", "what to measure: prefill, decode or both")
	fs.StringVar(&cfg.Model, "model", "", "model to request (default: the first /v1/models lists)")
	fs.StringVar(&out, "file", "profile.json", "file to write the profile to")
	deprecatedAlias(fs, "out", "file")
	fs.IntSliceVar(&cfg.ISLs, "isl", cfg.ISLs, "prefill: input lengths in tokens")
	fs.IntSliceVar(&cfg.PrefillConcurrency, "prefill-concurrency", cfg.PrefillConcurrency, "prefill: concurrent requests")
	fs.IntVar(&cfg.PrefillRequests, "prefill-requests", cfg.PrefillRequests, "prefill: requests per concurrent client and point")
	fs.IntSliceVar(&cfg.Contexts, "context", cfg.Contexts, "decode: prompt lengths in tokens")
	fs.IntSliceVar(&cfg.DecodeConcurrency, "decode-concurrency", cfg.DecodeConcurrency, "decode: concurrent streams")
	fs.IntVar(&cfg.OSL, "osl", cfg.OSL, "decode: output tokens per stream")
	fs.DurationVar(&timeout, "timeout", 10*time.Minute, "give up after this long")
	return cmd
}
