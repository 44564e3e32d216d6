package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/engines"
	xdspolicy "github.com/kvrelay/kvrelay/xds/policy"
)

// ctlTokenEnv holds the operator API token when --token-file is not given.
const ctlTokenEnv = "KVRELAY_API_TOKEN"

// ctlOptions are the flags every ctl subcommand shares.
type ctlOptions struct {
	api        string
	tokenFile  string
	caFile     string
	serverName string
	output     string
	timeout    time.Duration
}

func newCtlCmd() *cobra.Command {
	o := &ctlOptions{}
	cmd := &cobra.Command{
		Use:   "ctl",
		Short: "Inspect and change a running control plane through its operator API",
		Long: `ctl talks to the control plane's operator API (JSON over HTTP on its --api-listen
address): workers, drain and undrain, the routing policy, the KV index and the connected
proxies. Calls that change something need the control plane's token, read from --token-file
or from $` + ctlTokenEnv + `; reads need it too unless the control plane listens on loopback.

  kvrelay ctl workers
  kvrelay ctl workers add 'id=w5,url=http://127.0.0.1:8005,kv-events=tcp://127.0.0.1:5565,engine=sim'
  kvrelay ctl drain w5
  kvrelay ctl policy set --temperature 0.1 --cache-threshold 0.4
  kvrelay ctl index -o json`,
		Args:         cobra.NoArgs,
		SilenceUsage: true,
		RunE:         func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&o.api, "api", "127.0.0.1:18080", "control plane's operator API: host:port or a URL (https://…)")
	pf.StringVar(&o.tokenFile, "token-file", "", "file holding the API token (default: $"+ctlTokenEnv+")")
	pf.StringVar(&o.caFile, "api-ca", "", "CA certificate (PEM) that verifies the operator API's (a control plane with --api-cert): --api host:port is then https")
	pf.StringVar(&o.serverName, "api-server-name", "", "name the operator API's certificate must carry (default: the --api host)")
	pf.StringVarP(&o.output, "output", "o", "table", "output format: table or json")
	pf.DurationVar(&o.timeout, "timeout", 10*time.Second, "how long a call may take")
	cmd.AddCommand(ctlWorkersCmd(o), ctlDrainCmd(o, true), ctlDrainCmd(o, false), ctlPolicyCmd(o),
		ctlIndexCmd(o), ctlProxiesCmd(o), ctlTenantsCmd(o), ctlKeysCmd(o), ctlDecisionsCmd(o), ctlPrefixesCmd(o))
	return cmd
}

func ctlWorkersCmd(o *ctlOptions) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "workers",
		Short: "List the workers with their health, load, indexed blocks and KV event counters",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var l operatorv1.ListWorkersResponse
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/workers", nil, &l); err != nil {
				return err
			}
			return c.print(&l, func(w io.Writer) { ctlWorkerTable(w, l.Workers...) })
		},
	}
	get := &cobra.Command{
		Use:   "get ID",
		Short: "Show one worker",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return o.workerCall(cmd, http.MethodGet, ctlWorkerPath(args[0], ""), nil)
		},
	}
	add := &cobra.Command{
		Use:   "add SPEC",
		Short: "Add a worker, or replace the spec of the one with its id",
		Long: `add registers a worker through the API. SPEC is the --worker form of the control plane:
comma-separated key=value pairs with the keys id and url (both required), model, role
(both, prefill, decode), block-size, kv-events, kv-events-bind, kv-events-topic,
kv-events-replay, metrics, engine (vllm, sglang, trtllm, sim), max-num-seqs and
max-num-batched-tokens.`,
		Example: "  kvrelay ctl workers add 'id=w5,url=http://127.0.0.1:8005,kv-events=tcp://127.0.0.1:5565,engine=sim'",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec, err := parseCtlWorkerSpec(args[0])
			if err != nil {
				return err
			}
			return o.workerCall(cmd, http.MethodPut, ctlWorkerPath(spec.Id, ""), spec)
		},
	}
	rm := &cobra.Command{
		Use:     "rm ID",
		Aliases: []string{"remove"},
		Short:   "Remove a worker added through the API",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var r operatorv1.RemoveWorkerResponse
			if err := c.call(cmd.Context(), http.MethodDelete, ctlWorkerPath(args[0], ""), nil, &r); err != nil {
				return err
			}
			return c.print(&r, func(w io.Writer) { fmt.Fprintf(w, "removed %s\n", args[0]) })
		},
	}
	cmd.AddCommand(get, add, rm)
	return cmd
}

func ctlDrainCmd(o *ctlOptions, drain bool) *cobra.Command {
	verb, short := "drain", "Keep new requests away from a worker (requests in flight finish)"
	if !drain {
		verb, short = "undrain", "Let new requests reach a drained worker again"
	}
	return &cobra.Command{
		Use:   verb + " ID",
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return o.workerCall(cmd, http.MethodPost, ctlWorkerPath(args[0], verb), nil)
		},
	}
}

// workerCall makes a call that answers a Worker and prints it.
func (o *ctlOptions) workerCall(cmd *cobra.Command, method, path string, body proto.Message) error {
	c, err := o.client(cmd)
	if err != nil {
		return err
	}
	var w operatorv1.Worker
	if err := c.call(cmd.Context(), method, path, body, &w); err != nil {
		return err
	}
	return c.print(&w, func(out io.Writer) { ctlWorkerTable(out, &w) })
}

func ctlWorkerPath(id, action string) string {
	p := "/v1/workers/" + url.PathEscape(id)
	if action != "" {
		p += "/" + action
	}
	return p
}

func ctlPolicyCmd(o *ctlOptions) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Show the routing policy the proxies apply",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var p operatorv1.Policy
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/policy", nil, &p); err != nil {
				return err
			}
			return c.print(&p, func(w io.Writer) { ctlPolicyTable(w, &p) })
		},
	}
	var (
		policy, profileFile                            string
		disagg                                         string
		disaggThreshold                                int64
		kernelSignals                                  bool
		overlap, queue, temperature, threshold, busyKV float64
		computeWeight, backgroundWeight                float64
		tierWeights                                    []float64
		busyPrefill, busyDecode                        uint64
		sessionTTL                                     time.Duration
	)
	set := &cobra.Command{
		Use:   "set",
		Short: "Change the routing policy: only the flags given change",
		Long: `set reads the current policy, changes the fields whose flags are given, and stores the
result as a new version, which the control plane pushes to every proxy.`,
		Example: "  kvrelay ctl policy set --policy kv --overlap-weight 64 --queue-weight 8 --cache-threshold 0.1",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fs := cmd.Flags()
			changed := false
			fs.VisitAll(func(f *pflag.Flag) {
				if f.Changed && !slices.Contains(ctlGlobalFlags, f.Name) {
					changed = true
				}
			})
			if !changed {
				return errors.New("policy set: nothing to change (see --help for the flags)")
			}
			return ctlUpdatePolicy(cmd, o, func(p *operatorv1.Policy) error {
				if fs.Changed("policy") {
					p.Policy = policy
					if policy != xdspolicy.Custom {
						p.Profile = nil // a built-in name routes by its preset
					}
				}
				if fs.Changed("profile-file") {
					prof, err := readProfile(profileFile)
					if err != nil {
						return err
					}
					p.Policy, p.Profile = xdspolicy.Custom, prof
				}
				if fs.Changed("overlap-weight") {
					p.OverlapWeight = overlap
				}
				if fs.Changed("kernel-load-signals") {
					p.KernelLoadSignals = kernelSignals
				}
				if fs.Changed("disagg") {
					p.Disagg = disagg
				}
				if fs.Changed("disagg-threshold") {
					p.DisaggThreshold = &disaggThreshold
				}
				if fs.Changed("queue-weight") {
					p.QueueWeight = queue
				}
				if fs.Changed("temperature") {
					p.Temperature = temperature
				}
				if fs.Changed("cache-threshold") {
					p.CacheThreshold = threshold
				}
				if fs.Changed("tier-weights") {
					p.TierWeights = tierWeights
				}
				if fs.Changed("busy-prefill-tokens") {
					p.BusyPrefillTokens = busyPrefill
				}
				if fs.Changed("busy-decode-blocks") {
					p.BusyDecodeBlocks = busyDecode
				}
				if fs.Changed("busy-kv-fraction") {
					p.BusyKvFraction = busyKV
				}
				if fs.Changed("session-ttl") {
					p.SessionTtlMs = sessionTTL.Milliseconds()
				}
				if fs.Changed("compute-weight") {
					p.ComputeWeight = &computeWeight
				}
				if fs.Changed("background-weight") {
					p.BackgroundWeight = &backgroundWeight
				}
				return nil
			})
		},
	}
	fs := set.Flags()
	fs.StringVar(&policy, "policy", "", "routing policy: "+strings.Join(registry.PolicyNames(), ", "))
	fs.StringVar(&profileFile, "profile-file", "", "YAML or JSON file of a policy profile (filters, scorers, picker, spread: see kvrelay ctl policy -o json of a custom policy); sets the policy to custom")
	fs.Float64Var(&overlap, "overlap-weight", 0, "KV cost of a prompt block the worker must compute (a block held by decodes costs 1)")
	fs.BoolVar(&kernelSignals, "kernel-load-signals", false, "count connections waiting in a worker's accept queue, and the requests its recent first-byte latency implies, as waiting load (eBPF, where the control plane runs the probes)")
	fs.StringVar(&disagg, "disagg", "", "auto (split requests into prefill and decode legs when the pool has both roles) or off")
	fs.Int64Var(&disaggThreshold, "disagg-threshold", 0, "prompts whose uncached part on the decode worker is at most this many tokens prefill there (negative: always remotely)")
	fs.Float64Var(&queue, "queue-weight", 0, "KV cost of a block of the worker's prefill backlog (uncached tokens it still has to compute)")
	fs.Float64Var(&temperature, "temperature", 0, "> 0 samples workers by a softmax over normalised costs")
	fs.Float64Var(&threshold, "cache-threshold", 0, "below this cached share of the prompt, spread by load")
	fs.Float64SliceVar(&tierWeights, "tier-weights", nil, "`gpu,host,disk,shared` weights of a cached block in each tier (e.g. 1,0.75,0.25,0.2; a tier left out keeps its default)")
	fs.Uint64Var(&busyPrefill, "busy-prefill-tokens", 0, "a worker with more uncached prompt tokens in flight takes no new request (0: off)")
	fs.Uint64Var(&busyDecode, "busy-decode-blocks", 0, "a worker holding more KV blocks takes no new request (0: off)")
	fs.Float64Var(&busyKV, "busy-kv-fraction", 0, "a worker using more of its KV cache takes no new request (0: off)")
	fs.DurationVar(&sessionTTL, "session-ttl", 0, "how long session affinity lasts (e.g. 10m)")
	fs.Float64Var(&computeWeight, "compute-weight", 0, "latency policy: the request's own prefill time weighed again beside its predicted TTFT")
	fs.Float64Var(&backgroundWeight, "background-weight", 0, "latency policy: a background request's prefill time weighed once more per interactive request on the worker")
	cmd.AddCommand(set, ctlRolloutCmd(o), ctlHistoryCmd(o))
	return cmd
}

// ctlUpdatePolicy reads the current policy, lets change edit it, stores the result as the
// next version and prints what the control plane stored.
func ctlUpdatePolicy(cmd *cobra.Command, o *ctlOptions, change func(p *operatorv1.Policy) error) error {
	c, err := o.client(cmd)
	if err != nil {
		return err
	}
	var p operatorv1.Policy
	if err := c.call(cmd.Context(), http.MethodGet, "/v1/policy", nil, &p); err != nil {
		return err
	}
	if err := change(&p); err != nil {
		return err
	}
	var stored operatorv1.Policy
	if err := c.call(cmd.Context(), http.MethodPut, "/v1/policy", &p, &stored); err != nil {
		return err
	}
	return c.print(&stored, func(w io.Writer) { ctlPolicyTable(w, &stored) })
}

// ctlGlobalFlags are ctl's persistent flags, which do not count as changes to a policy.
var ctlGlobalFlags = []string{"api", "token-file", "output", "timeout"}

func ctlIndexCmd(o *ctlOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "index",
		Short: "Show the global KV index: blocks in total and per worker, journal position, ingest rate",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var x operatorv1.Index
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/index", nil, &x); err != nil {
				return err
			}
			return c.print(&x, func(w io.Writer) {
				fmt.Fprintf(w, "blocks: %d  journal: epoch %d offset %d  ingest: %.1f block events/s\n\n",
					x.TotalBlocks, x.JournalEpoch, x.JournalOffset, x.IngestRate)
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tSLOT\tGPU\tCPU\tDISK\tSHARED")
				for _, wb := range x.Workers {
					b := wb.GetBlocks()
					fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\n", wb.Id, wb.Slot, b.GetGpu(), b.GetCpu(), b.GetDisk(), b.GetShared())
				}
				tw.Flush()
			})
		},
	}
}

func ctlProxiesCmd(o *ctlOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "proxies",
		Short: "List the proxies connected to the control plane and their latest NACK",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var l operatorv1.ListProxiesResponse
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/proxies", nil, &l); err != nil {
				return err
			}
			return c.print(&l, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "NODE\tSTREAMS\tLAST NACK")
				for _, p := range l.Proxies {
					nack := "-"
					if n := p.GetLastNack(); n != nil {
						nack = fmt.Sprintf("%s: %s", n.TypeUrl[strings.LastIndexByte(n.TypeUrl, '/')+1:], n.Reason)
						if n.UnixNano != 0 {
							nack += fmt.Sprintf(" (%s ago)", time.Since(time.Unix(0, n.UnixNano)).Round(time.Second))
						}
					}
					fmt.Fprintf(tw, "%s\t%d\t%s\n", p.NodeId, p.Streams, nack)
				}
				tw.Flush()
			})
		},
	}
}

func ctlTenantsCmd(o *ctlOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "tenants",
		Short: "List the tenants with budgets and what they ask of the proxies together",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.client(cmd)
			if err != nil {
				return err
			}
			var l operatorv1.ListTenantsResponse
			if err := c.call(cmd.Context(), http.MethodGet, "/v1/tenants", nil, &l); err != nil {
				return err
			}
			return c.print(&l, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "TENANT	PROXIES	REQUESTS/S	PROMPT TOKENS/S	OUTPUT TOKENS/S	ADMITTED	REFUSED")
				for _, t := range l.Tenants {
					fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.0f\t%.0f\t%d\t%d\n", t.GetName(), t.GetProxies(), t.GetRequestsPerSecond(),
						t.GetPromptTokensPerSecond(), t.GetOutputTokensPerSecond(), t.GetAdmitted(), t.GetRefused())
				}
				tw.Flush()
			})
		},
	}
}

func ctlWorkerTable(w io.Writer, workers ...*operatorv1.Worker) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tURL\tMODEL\tENGINE\tHEALTHY\tDRAINING\tRUNNING\tWAITING\tKV%\tBLOCKS\tTIERS\tEVENTS\tGAPS")
	yesNo := map[bool]string{true: "yes", false: "no"}
	for _, wk := range workers {
		s, st := wk.GetSpec(), wk.GetStatus()
		b := st.GetBlocks()
		model := s.GetModel()
		if model == "" {
			model = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%.0f\t%d\t%s\t%d\t%d\n", s.GetId(), s.GetUrl(), model,
			s.GetEngine(), yesNo[st.GetHealthy()], yesNo[st.GetDraining()], st.GetRunning(), st.GetWaiting(),
			100*st.GetKvUsage(), b.GetGpu()+b.GetCpu()+b.GetDisk()+b.GetShared(), ctlTiers(s), st.GetIngest().GetEvents(), st.GetIngest().GetGaps())
	}
	tw.Flush()
}

// ctlTiers is the worker's declared tier bandwidths, "host=25GB/s,disk=5GB/s", or "-".
func ctlTiers(s *operatorv1.WorkerSpec) string {
	var parts []string
	for _, t := range []struct {
		name string
		bw   float64
	}{{"host", s.GetHostBandwidth()}, {"disk", s.GetDiskBandwidth()}, {"shared", s.GetSharedBandwidth()}, {"peer", s.GetPeerBandwidth()}} {
		if t.bw > 0 {
			parts = append(parts, t.name+"="+engines.FormatBandwidth(t.bw))
		}
	}
	if p := s.GetP2PPort(); p > 0 {
		parts = append(parts, "p2p-port="+strconv.FormatUint(uint64(p), 10))
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, ",")
}

func ctlPolicyTable(w io.Writer, p *operatorv1.Policy) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	weights := make([]string, len(p.TierWeights))
	for i, x := range p.TierWeights {
		weights[i] = strconv.FormatFloat(x, 'g', -1, 64)
	}
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }
	for _, row := range [][2]string{
		{"version", strconv.FormatUint(p.Version, 10)},
		{"policy", p.Policy},
		{"overlap_weight", f(p.OverlapWeight)},
		{"queue_weight", f(p.QueueWeight)},
		{"temperature", f(p.Temperature)},
		{"cache_threshold", f(p.CacheThreshold)},
		{"tier_weights", strings.Join(weights, ",")},
		{"busy_prefill_tokens", strconv.FormatUint(p.BusyPrefillTokens, 10)},
		{"busy_decode_blocks", strconv.FormatUint(p.BusyDecodeBlocks, 10)},
		{"busy_kv_fraction", f(p.BusyKvFraction)},
		{"session_ttl", (time.Duration(p.SessionTtlMs) * time.Millisecond).String()},
		{"disagg", cmp.Or(p.Disagg, "auto")},
		{"kernel_load_signals", strconv.FormatBool(p.KernelLoadSignals)},
		{"disagg_threshold", disaggThresholdText(p.DisaggThreshold)},
		{"compute_weight", optionalText(p.ComputeWeight)},
		{"background_weight", optionalText(p.BackgroundWeight)},
	} {
		fmt.Fprintf(tw, "%s\t%s\n", row[0], row[1])
	}
	if pr := p.Profile; pr != nil {
		plugin := func(pl *operatorv1.Plugin) string {
			out := pl.GetName()
			if pl.GetWeight() != 0 {
				out += "×" + f(pl.GetWeight())
			}
			var params []string
			for _, k := range slices.Sorted(maps.Keys(pl.GetParams())) {
				params = append(params, k+"="+f(pl.GetParams()[k]))
			}
			if len(params) > 0 {
				out += "(" + strings.Join(params, ",") + ")"
			}
			return out
		}
		var filters, scorers []string
		for _, x := range pr.Filters {
			filters = append(filters, plugin(x))
		}
		for _, x := range pr.Scorers {
			scorers = append(scorers, plugin(x))
		}
		fmt.Fprintf(tw, "profile_filters\t%s\n", strings.Join(filters, " "))
		fmt.Fprintf(tw, "profile_scorers\t%s\n", strings.Join(scorers, " "))
		fmt.Fprintf(tw, "profile_picker\t%s\n", plugin(pr.Picker))
		if pr.Spread != nil {
			fmt.Fprintf(tw, "profile_spread\t%s\n", plugin(pr.Spread))
		}
	}
	if c := p.Candidate; c != nil {
		mode := "share " + f(p.CandidateShare)
		if p.Shadow {
			mode = "shadow"
		}
		fmt.Fprintf(tw, "candidate\tversion %d, %s, %s\n", c.Version, c.Policy, mode)
		fmt.Fprintf(tw, "candidate_overlap_weight\t%s\n", f(c.OverlapWeight))
		fmt.Fprintf(tw, "candidate_queue_weight\t%s\n", f(c.QueueWeight))
		fmt.Fprintf(tw, "candidate_cache_threshold\t%s\n", f(c.CacheThreshold))
	}
	tw.Flush()
}

// optionalText prints an optional weight, "proxy default" when unset.
func optionalText(v *float64) string {
	if v == nil {
		return "proxy default"
	}
	return strconv.FormatFloat(*v, 'g', -1, 64)
}

// parseCtlWorkerSpec reads the control plane's --worker form (registry.ParseWorker: the
// same keys, defaults and checks as `kvrelay controlplane --worker`) into a spec.
func parseCtlWorkerSpec(s string) (*operatorv1.WorkerSpec, error) {
	w, err := registry.ParseWorker(s)
	if err != nil {
		return nil, err
	}
	return &operatorv1.WorkerSpec{Id: w.ID, Url: w.URL, Model: w.Model, Role: w.Role, BlockSize: uint32(w.BlockSize),
		KvEvents: w.KVEvents, KvEventsBind: w.KVEventsBind, KvEventsTopic: w.KVEventsTopic, KvEventsReplay: w.KVEventsReplay, Metrics: w.Metrics,
		Engine: w.Engine, MaxNumSeqs: uint32(w.MaxNumSeqs), MaxNumBatchedTokens: uint32(w.MaxNumBatchedTokens), LoraModules: w.LoRAModules,
		KvBytesPerToken: uint64(w.KVBytesPerToken), HostBandwidth: w.HostBandwidth, DiskBandwidth: w.DiskBandwidth, SharedBandwidth: w.SharedBandwidth, PeerBandwidth: w.PeerBandwidth,
		P2PPort: uint32(w.P2PPort)}, nil
}

// ctlClient calls the operator API over HTTP.
type ctlClient struct {
	base   string
	token  string
	json   bool
	out    io.Writer
	client *http.Client
}

// client checks the shared flags and returns a client for cmd.
func (o *ctlOptions) client(cmd *cobra.Command) (*ctlClient, error) {
	c := &ctlClient{out: cmd.OutOrStdout(), client: &http.Client{Timeout: o.timeout}}
	switch o.output {
	case "table":
	case "json":
		c.json = true
	default:
		return nil, fmt.Errorf("-o %q: want table or json", o.output)
	}
	c.base = strings.TrimSuffix(o.api, "/")
	if !strings.Contains(c.base, "://") {
		if o.caFile != "" {
			c.base = "https://" + c.base
		} else {
			c.base = "http://" + c.base
		}
	}
	if o.caFile != "" || o.serverName != "" {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: o.serverName}
		if o.caFile != "" {
			pem, err := os.ReadFile(o.caFile)
			if err != nil {
				return nil, fmt.Errorf("reading --api-ca: %w", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--api-ca %s holds no PEM certificate", o.caFile)
			}
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = cfg
		c.client.Transport = tr
	}
	if u, err := url.Parse(c.base); err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("--api %q: want host:port or an http(s) URL", o.api)
	}
	if o.tokenFile != "" {
		data, err := os.ReadFile(o.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading --token-file: %w", err)
		}
		if c.token = strings.TrimSpace(string(data)); c.token == "" {
			return nil, fmt.Errorf("--token-file %s is empty", o.tokenFile)
		}
	} else {
		c.token = strings.TrimSpace(os.Getenv(ctlTokenEnv))
	}
	return c, nil
}

// call sends body (if any) as JSON and decodes the answer into out; an error answer becomes
// an error carrying the control plane's message.
func (c *ctlClient) call(ctx context.Context, method, path string, body, out proto.Message) error {
	data, err := c.do(ctx, method, path, body)
	if err != nil {
		return err
	}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(data, out); err != nil {
		return fmt.Errorf("%s %s: decoding the answer: %w", method, path, err)
	}
	return nil
}

// getJSON reads path's plain JSON answer (the console's endpoints) into out.
func (c *ctlClient) getJSON(ctx context.Context, path string, out any) error {
	data, err := c.do(ctx, http.MethodGet, path, nil)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("GET %s: decoding the answer: %w", path, err)
	}
	return nil
}

// do makes one call and returns the body of a 2xx answer, or the API's error. A 503 (a
// replica that does not lead and does not know the leader yet, during a failover) changed
// nothing, so do asks again, up to ctlTries times in all, waiting the answer's Retry-After
// (at most a second) or a growing 100 ms between.
func (c *ctlClient) do(ctx context.Context, method, path string, body proto.Message) ([]byte, error) {
	var payload []byte
	if body != nil {
		data, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(body)
		if err != nil {
			return nil, fmt.Errorf("encoding the request: %w", err)
		}
		payload = data
	}
	for try := 1; ; try++ {
		data, status, wait, err := c.once(ctx, method, path, payload)
		if status != http.StatusServiceUnavailable || try == ctlTries {
			return data, err
		}
		if wait <= 0 {
			wait = time.Duration(try) * 100 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return data, err
		case <-time.After(min(wait, time.Second)):
		}
	}
}

// ctlTries bounds the calls do makes for one answered 503 after another.
const ctlTries = 5

// once makes one call: the body of a 2xx answer, or the API's error with the answer's status
// and its Retry-After.
func (c *ctlClient) once(ctx context.Context, method, path string, payload []byte) ([]byte, int, time.Duration, error) {
	var rd io.Reader
	if payload != nil {
		rd = bytes.NewReader(payload)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("%s %s: %w", method, path, err)
	}
	if payload != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("calling the control plane's API: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, resp.StatusCode, 0, fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		var wait time.Duration
		if n, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && n > 0 {
			wait = time.Duration(n) * time.Second
		}
		var e struct {
			Error struct{ Message, Code string }
		}
		if json.Unmarshal(data, &e) == nil && e.Error.Message != "" {
			return nil, resp.StatusCode, wait, fmt.Errorf("%s %s: %s (%d %s)", method, path, e.Error.Message, resp.StatusCode, e.Error.Code)
		}
		return nil, resp.StatusCode, wait, fmt.Errorf("%s %s: %s: %.200s", method, path, resp.Status, bytes.TrimSpace(data))
	}
	return data, resp.StatusCode, 0, nil
}

// print writes m as JSON with -o json, else as table writes it.
func (c *ctlClient) print(m proto.Message, table func(io.Writer)) error {
	if !c.json {
		table(c.out)
		return nil
	}
	data, err := ctlJSON(m)
	if err != nil {
		return fmt.Errorf("encoding the output: %w", err)
	}
	_, err = fmt.Fprintf(c.out, "%s\n", data)
	return err
}

func disaggThresholdText(t *int64) string {
	if t == nil {
		return "proxy default"
	}
	return strconv.FormatInt(*t, 10)
}

// readProfile reads a policy profile from a YAML or JSON file (parseProfile).
func readProfile(path string) (*operatorv1.Profile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading --profile-file: %w", err)
	}
	p, err := parseProfile(data)
	if err != nil {
		return nil, fmt.Errorf("--profile-file %s: %w", path, err)
	}
	return p, nil
}

// parseProfile reads a policy profile in YAML or JSON, the form ctl policy -o json prints
// under "profile"; unknown fields are refused.
func parseProfile(data []byte) (*operatorv1.Profile, error) {
	var doc any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	js, err := json.Marshal(doc)
	if err != nil {
		return nil, err
	}
	var p operatorv1.Profile
	if err := protojson.Unmarshal(js, &p); err != nil {
		return nil, err
	}
	return &p, nil
}
