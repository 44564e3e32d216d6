// Command bench-xds measures what issue 5 asks of the control plane and its xDS push, each
// mode self-contained on loopback in this process (and, where proxy CPU is measured, one
// child process of the same binary playing the proxies' xDS side):
//
//	go run ./hack/bench-xds -mode freshness -rate 100000 -proxies 8 -duration 10s
//	go run ./hack/bench-xds -mode pushcost  -rate 100000 -proxies 8 -duration 10s
//	go run ./hack/bench-xds -mode herding   -proxies 4 -workers 8 -requests 800
//	go run ./hack/bench-xds -mode cpkill    -proxies 2 -workers 4 -duration 20s
//	go run ./hack/bench-xds -mode precision
//	go run ./hack/bench-xds -mode scale     -rate 100000 -proxies 100 -workers 1000 -replicas 2
//
// Results are printed as plain "key=value" lines, one per measurement; -json prints them
// as one JSON object instead. See README.md for what each mode measures and how.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"time"
)

type flags struct {
	mode        string
	rate        float64
	proxies     int
	workers     int
	duration    time.Duration
	requests    int
	concurrency int
	batch       int
	sample      int
	maxBlocks   int
	linger      time.Duration
	inProcess   bool
	enginesPer  int
	firstWorker int
	jsonOut     bool
	verbose     bool
	sharing     string
	speedup     float64
	cpuProfile  string
	profileFor  time.Duration
	timeline    bool

	// scale mode
	replicas      int
	models        int
	allWorkers    bool
	loadBudget    int
	reportWorkers int
	scrape        time.Duration
	specsFile     string
	share         string
	api, peers    string

	// child ("subscribe") mode
	xds      string
	outFile  string
	nodeBase string
}

func main() {
	var f flags
	flag.StringVar(&f.mode, "mode", "", "freshness | pushcost | herding | cpkill | precision | scale")
	flag.Float64Var(&f.rate, "rate", 100000, "freshness, pushcost: BlockStored events per second, all workers together")
	flag.IntVar(&f.proxies, "proxies", 0, "proxies (journal subscribers in freshness/pushcost); 0 = the mode's default")
	flag.IntVar(&f.workers, "workers", 0, "workers (synthetic publishers or simulated engines); 0 = the mode's default")
	flag.DurationVar(&f.duration, "duration", 0, "how long the load runs; 0 = the mode's default")
	flag.IntVar(&f.requests, "requests", 800, "herding: requests per run")
	flag.IntVar(&f.concurrency, "concurrency", 0, "herding, cpkill: concurrent clients; 0 = the mode's default")
	flag.IntVar(&f.batch, "batch", 0, "freshness, pushcost: events per published message; 0 = 1 below 10k events/s, else 16")
	flag.IntVar(&f.sample, "sample", -1, "freshness: time one block in 2^sample (by seq hash); -1 = all below 10k events/s, else 1 in 4")
	flag.IntVar(&f.maxBlocks, "max-blocks", 1<<20, "freshness, pushcost: blocks held across the workers before old ones are removed")
	flag.DurationVar(&f.linger, "linger", 0, "freshness, pushcost: the control plane's journal linger (0 = its default, 2 ms)")
	flag.IntVar(&f.enginesPer, "engines-per-process", 2000, "freshness, pushcost, scale: synthetic engines per engine process (each holds a listener, a ZMQ socket and its subscribers' connections: a process's 20,000 files bound it)")
	flag.IntVar(&f.firstWorker, "first-worker", 0, "engines (child): the index of this process's first worker")
	flag.BoolVar(&f.inProcess, "in-process", false, "freshness, pushcost: run the subscribers in this process instead of a child process")
	flag.BoolVar(&f.jsonOut, "json", false, "print the results as one JSON object")
	flag.BoolVar(&f.verbose, "v", false, "log the components' own messages to stderr")
	flag.StringVar(&f.sharing, "sharing", "on,off", "herding: in-flight load sharing settings to run, in order; precision: off runs the xds proxy without load reports")
	flag.Float64Var(&f.speedup, "speedup", 20, "herding, cpkill, precision: simulated engine speedup")
	flag.BoolVar(&f.timeline, "timeline", false, "freshness: also print p50/p99 per second of publish time")
	flag.IntVar(&f.loadBudget, "load-push-budget", 0, "scale: the replicas' LoadPushBudget, bytes a second of loads on each proxy's stream (0: none)")
	flag.BoolVar(&f.allWorkers, "all-workers", false, "scale, with -models: the proxies do not name their model to the control plane, which then sends every Worker resource (their loads and journal stay scoped)")
	flag.IntVar(&f.models, "models", 1, "scale: models the workers serve (worker i serves model i mod N); with more than one, proxy i routes model i mod N only (--serve-models) and follows that part of the index")
	flag.IntVar(&f.replicas, "replicas", 2, "scale: control-plane replicas (each a process ingesting every engine and serving xDS)")
	flag.IntVar(&f.reportWorkers, "report-workers", 100, "scale: workers each proxy reports in-flight load for (a tenth of them changing every report)")
	flag.DurationVar(&f.scrape, "scrape", time.Second, "scale: the replicas' metrics scrape interval per worker")
	flag.StringVar(&f.share, "share", "none", "scale: what the replicas share through --replica-peers: none, polls (each engine scraped by one of them, the others taking its readings) or all (polls and their proxies' in-flight load)")
	flag.StringVar(&f.specsFile, "specs", "", "replica: the workers, as JSON; not for direct use")
	flag.StringVar(&f.api, "api", "", "replica: its operator API's address; not for direct use")
	flag.StringVar(&f.peers, "peers", "", "replica: the other replicas' operator API addresses; not for direct use")
	flag.StringVar(&f.cpuProfile, "cpuprofile", "", "write this process's CPU profile to the file (scale: each child's to FILE.<child>)")
	flag.DurationVar(&f.profileFor, "cpuprofile-for", 0, "end the CPU profile after this long instead of at exit (a child that is killed leaves one)")
	// The child process's flags (mode "subscribe"); not for direct use.
	flag.StringVar(&f.xds, "xds", "", "subscribe: the control plane's xDS address")
	flag.StringVar(&f.outFile, "out", "", "subscribe: file for the arrival records")
	flag.StringVar(&f.nodeBase, "node", "bench", "subscribe: node id prefix")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench-xds: ")
	jsonMode = f.jsonOut

	if f.cpuProfile != "" {
		fh, err := os.Create(f.cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(fh); err != nil {
			log.Fatal(err)
		}
		if f.profileFor > 0 {
			time.AfterFunc(f.profileFor, pprof.StopCPUProfile)
		}
		defer pprof.StopCPUProfile()
	}
	var err error
	res := &results{}
	if f.mode != "subscribe" && f.mode != "engines" && f.mode != "replica" && f.mode != "sinks" {
		res.add("host", "cpus", runtime.NumCPU(), "loadavg_at_start", loadavg())
	}
	switch f.mode {
	case "freshness", "pushcost":
		defaults(&f.proxies, 8)
		defaults(&f.workers, 8)
		if f.duration == 0 {
			f.duration = 10 * time.Second
		}
		err = runIngest(f, res)
	case "scale":
		defaults(&f.proxies, 100)
		defaults(&f.workers, 1000)
		if f.duration == 0 {
			f.duration = 15 * time.Second
		}
		err = runScale(f, res)
	case "replica", "sinks":
		run := runReplicaChild
		if f.mode == "sinks" {
			run = runSinksChild
		}
		if err := run(f); err != nil {
			log.Fatal(err)
		}
		return
	case "engines":
		if err := runEnginesChild(f); err != nil {
			log.Fatal(err)
		}
		return
	case "subscribe":
		err = runSubscribeChild(f)
		if err != nil {
			log.Fatal(err)
		}
		return
	case "herding":
		defaults(&f.proxies, 4)
		defaults(&f.workers, 8)
		defaults(&f.concurrency, 32)
		err = runHerding(f, res)
	case "cpkill":
		defaults(&f.proxies, 2)
		defaults(&f.workers, 4)
		defaults(&f.concurrency, 16)
		if f.duration == 0 {
			f.duration = 20 * time.Second
		}
		err = runCPKill(f, res)
	case "precision":
		defaults(&f.workers, 4)
		err = runPrecision(f, res)
	default:
		flag.Usage()
		os.Exit(2)
	}
	res.add("host", "loadavg_at_end", loadavg())
	res.print(f.jsonOut)
	if err != nil {
		pprof.StopCPUProfile()
		log.Fatal(err)
	}
}

func defaults(v *int, d int) {
	if *v == 0 {
		*v = d
	}
}

// logger returns the components' logger: silent unless -v.
func logger(f flags) *slog.Logger {
	if f.verbose {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.DiscardHandler)
}

// results collects result lines: a line is a name and ordered key=value fields.
type results struct {
	lines []line
}

type line struct {
	name   string
	fields []field
}

type field struct {
	k string
	v any
}

// add appends a line; kv alternates keys and values.
func (r *results) add(name string, kv ...any) {
	l := line{name: name}
	for i := 0; i+1 < len(kv); i += 2 {
		l.fields = append(l.fields, field{k: kv[i].(string), v: kv[i+1]})
	}
	r.lines = append(r.lines, l)
	if !jsonMode {
		fmt.Println(l.String())
	}
}

var jsonMode bool

func (l line) String() string {
	var b strings.Builder
	b.WriteString(l.name)
	for _, f := range l.fields {
		fmt.Fprintf(&b, " %s=%s", f.k, format(f.v))
	}
	return b.String()
}

func format(v any) string {
	switch x := v.(type) {
	case float64:
		switch {
		case x == 0:
			return "0"
		case x >= 100 || x <= -100:
			return fmt.Sprintf("%.0f", x)
		case x >= 1 || x <= -1:
			return fmt.Sprintf("%.2f", x)
		default:
			return fmt.Sprintf("%.3g", x)
		}
	case time.Duration:
		switch {
		case x >= 10*time.Second:
			return x.Round(100 * time.Millisecond).String()
		case x >= 10*time.Millisecond:
			return x.Round(100 * time.Microsecond).String()
		default:
			return x.Round(time.Microsecond).String()
		}
	case string:
		if strings.ContainsAny(x, " \t") {
			return fmt.Sprintf("%q", x)
		}
		return x
	}
	return fmt.Sprint(v)
}

func (r *results) print(asJSON bool) {
	if !asJSON {
		return
	}
	out := map[string]any{}
	for _, l := range r.lines {
		m := map[string]any{}
		for _, f := range l.fields {
			if d, ok := f.v.(time.Duration); ok {
				m[f.k+"_ms"] = float64(d) / 1e6
				continue
			}
			m[f.k] = f.v
		}
		name := l.name
		for i := 2; out[name] != nil; i++ {
			name = fmt.Sprintf("%s#%d", l.name, i)
		}
		out[name] = m
	}
	b, _ := json.MarshalIndent(out, "", "  ")
	fmt.Println(string(b))
}

// percentiles returns p50, p99 and max of ds (sorted in place).
func percentiles(ds []time.Duration) (p50, p99, mx time.Duration) {
	if len(ds) == 0 {
		return 0, 0, 0
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	at := func(q float64) time.Duration {
		i := int(q * float64(len(ds)))
		if i >= len(ds) {
			i = len(ds) - 1
		}
		return ds[i]
	}
	return at(0.50), at(0.99), ds[len(ds)-1]
}

func errorf(format string, args ...any) error { return fmt.Errorf(format, args...) }

// loadavg is the host's 1-minute load average, as /proc/loadavg says ("?" elsewhere).
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "?"
}
