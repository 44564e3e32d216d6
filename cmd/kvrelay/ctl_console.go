package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrelay/kvrelay/controlplane"
)

// ctlDecisionsCmd lists the proxies' sampled routing decisions the control plane keeps, or
// explains one (the console's /v1/decisions endpoints).
func ctlDecisionsCmd(o *ctlOptions) *cobra.Command {
	var n int
	cmd := &cobra.Command{
		Use:   "decisions [ID]",
		Short: "List the proxies' sampled routing decisions, or explain one with every candidate",
		Long: `decisions lists the latest routing decisions the proxies sampled (one request in eight)
and reported with their load: the picked worker, the rule that decided, the prompt blocks it
cached and the most any candidate did (their difference the regret), and how the answer went.
With an ID it shows that decision's every candidate: cached blocks, load, and under the
latency policy the predicted TTFT split into queue and prefill.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			if len(args) == 1 {
				if _, err := strconv.ParseUint(args[0], 10, 64); err != nil {
					return fmt.Errorf("decision id %q is not a number", args[0])
				}
				var d controlplane.DecisionView
				if err := c.getJSON(cmd.Context(), "/v1/decisions/"+args[0], &d); err != nil {
					return err
				}
				return c.printJSON(d, func(w io.Writer) { ctlDecisionDetail(w, d) })
			}
			var l struct {
				Decisions []controlplane.DecisionView `json:"decisions"`
				Last      uint64                      `json:"last"`
			}
			if err := c.getJSON(cmd.Context(), "/v1/decisions?n="+strconv.Itoa(n), &l); err != nil {
				return err
			}
			return c.printJSON(l, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tTIME\tPROXY\tMODEL\tPROMPT\tWORKER\tMODE\tCACHED\tREGRET\tTTFT\tSTATUS")
				for _, d := range l.Decisions {
					fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%.0f\t%.0f\t%s\t%d\n", d.ID, d.Time.Format("15:04:05.000"), d.Proxy, d.Model,
						d.PromptTokens, d.Worker, d.Mode, d.OverlapBlocks, d.RegretBlocks, msText(d.TTFTMs), d.Status)
				}
				tw.Flush()
			})
		},
	}
	cmd.Flags().IntVarP(&n, "last", "n", 20, "how many of the latest decisions")
	return cmd
}

func ctlDecisionDetail(w io.Writer, d controlplane.DecisionView) {
	fmt.Fprintf(w, "decision %d at %s by proxy %s: %s, %d prompt tokens, priority %d\n", d.ID, d.Time.Format("15:04:05.000"), d.Proxy, d.Model, d.PromptTokens, d.Priority)
	fmt.Fprintf(w, "picked %s by %s under policy version %d: %.0f prompt blocks cached, best candidate %.0f (regret %.0f)\n",
		d.Worker, d.Mode, d.PolicyVersion, d.OverlapBlocks, d.AchievableBlocks, d.RegretBlocks)
	fmt.Fprintf(w, "answer: status %d, TTFT %s, ITL %s, %d tokens cached\n\n", d.Status, msText(d.TTFTMs), msText(d.ITLMs), d.CachedTokens)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CANDIDATE\tCACHED\tREQUESTS\tTTFT\tQUEUE\tPREFILL")
	for _, c := range d.Candidates {
		name := c.Worker
		if c.Worker == d.Worker {
			name += " (picked)"
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%d\t%s\t%s\t%s\n", name, c.CachedBlocks, c.Requests, msText(c.TTFTMs), msText(c.QueueMs), msText(c.PrefillMs))
	}
	tw.Flush()
}

// ctlPrefixesCmd lists the hottest shared prompt prefixes (the console's /v1/prefixes).
func ctlPrefixesCmd(o *ctlOptions) *cobra.Command {
	var n int
	cmd := &cobra.Command{
		Use:   "prefixes",
		Short: "List the prompt prefixes most sampled requests shared lately, and where they went",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var l struct {
				Prefixes []controlplane.PrefixView `json:"prefixes"`
			}
			if err := c.getJSON(cmd.Context(), "/v1/prefixes?n="+strconv.Itoa(n), &l); err != nil {
				return err
			}
			return c.printJSON(l, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "PREFIX\tMODEL\tBLOCKS\tHITS\tWORKERS")
				for _, p := range l.Prefixes {
					ws := slices.Sorted(maps.Keys(p.Workers))
					parts := make([]string, len(ws))
					for i, id := range ws {
						parts[i] = id + "×" + strconv.Itoa(p.Workers[id])
					}
					fmt.Fprintf(tw, "%s\t%s\t%d\t%.1f\t%s\n", p.Prefix, p.Model, p.Blocks, p.Hits, strings.Join(parts, " "))
				}
				tw.Flush()
			})
		},
	}
	cmd.Flags().IntVarP(&n, "top", "n", 10, "how many prefixes")
	return cmd
}

// printJSON writes v as indented JSON with -o json, else as table writes it.
func (c *ctlClient) printJSON(v any, table func(io.Writer)) error {
	if !c.json {
		table(c.out)
		return nil
	}
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding the output: %w", err)
	}
	_, err = fmt.Fprintf(c.out, "%s\n", data)
	return err
}

func msText(v float64) string {
	if v <= 0 {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 1, 64) + "ms"
}
