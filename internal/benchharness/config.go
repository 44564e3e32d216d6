package benchharness

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Config is what every run of a harness shares: binaries, model, ports, router options and
// bounds. Build it, then Prepare it once before the first run.
type Config struct {
	// Name prefixes the harness's messages and result headers ("bench-llmd").
	Name string
	// Model is the model every engine serves.
	Model string
	// Out is where the kvrelay and gateway binaries are built (Out/bin).
	Out string
	// Root is the kvrelay checkout; Version its commit ("+dirty" with local changes).
	Root, Version string
	// EPPBin, SimBin: llm-d's endpoint picker and simulator ("" looks them up on PATH);
	// KVRelayBin: a prebuilt kvrelay ("" builds one into Out/bin); GatewayBin is set by
	// Prepare.
	EPPBin, SimBin, KVRelayBin, GatewayBin string
	// Seed seeds every workload.
	Seed uint64
	// PortBase: each run listens on 127.0.0.1 ports PortBase+1 … PortBase+201 (see Ports).
	PortBase int
	// ExactTok and ApproxTok are the kvrelay proxies' --tokenizer on the exact and the
	// approximate index ("" for the proxy's default).
	ExactTok, ApproxTok string
	// PolicyArgs are extra policy flags for the kv and latency routers, ProxyArgs extra
	// proxy flags for them.
	PolicyArgs, ProxyArgs []string
	// Settle is the pause between the router being ready and the load; RunTimeout and
	// RequestTimeout bound a run and a request.
	Settle, RunTimeout, RequestTimeout time.Duration
}

// Prepare resolves the peer binaries, dropping the routers or engine kinds whose binary is
// missing (each drop is returned as a sentence), and builds kvrelay (unless KVRelayBin is
// set) and, when a router needs it, the gateway into Out/bin.
func (cfg *Config) Prepare(ctx context.Context, engines, routers []string) (keptEngines, keptRouters, skipped []string, err error) {
	if err := os.MkdirAll(filepath.Join(cfg.Out, "bin"), 0o755); err != nil {
		return nil, nil, nil, err
	}
	keptEngines, keptRouters = engines, routers
	if slices.ContainsFunc(routers, IsEPP) {
		if cfg.EPPBin, err = FindBinary(cfg.EPPBin, "epp"); err != nil {
			skipped = append(skipped, fmt.Sprintf("the epp routers (%v; set --epp or LLMD_EPP to the endpoint picker built from llm-d's router repository)", err))
			keptRouters = Without(keptRouters, IsEPP)
		}
	}
	if slices.Contains(engines, EngineLLMD) {
		if cfg.SimBin, err = FindBinary(cfg.SimBin, "llm-d-inference-sim"); err != nil {
			skipped = append(skipped, fmt.Sprintf("the llmd engines (%v; set --llmd-sim or LLMD_SIM to llm-d-inference-sim built from its repository)", err))
			keptEngines = Without(keptEngines, func(e string) bool { return e == EngineLLMD })
		}
	}
	if len(keptEngines) == 0 || len(keptRouters) == 0 {
		return keptEngines, keptRouters, skipped, errors.New("nothing left to run")
	}
	if cfg.Version == "" {
		cfg.Version = GitVersion(cfg.Root)
	}
	if cfg.KVRelayBin == "" {
		cfg.KVRelayBin = filepath.Join(cfg.Out, "bin", "kvrelay")
		if err := GoBuild(ctx, cfg.Root, cfg.KVRelayBin, "./cmd/kvrelay"); err != nil {
			return keptEngines, keptRouters, skipped, err
		}
	}
	if slices.ContainsFunc(keptRouters, BehindGateway) {
		cfg.GatewayBin = filepath.Join(cfg.Out, "bin", "llmd-gateway")
		if err := GoBuild(ctx, cfg.Root, cfg.GatewayBin, "./hack/bench-llmd/gateway"); err != nil {
			return keptEngines, keptRouters, skipped, err
		}
	}
	return keptEngines, keptRouters, skipped, nil
}

// CheckPortBase rejects a port base whose ports (base … base+201) do not fit.
func CheckPortBase(base int) error {
	if base < 1024 || base+201 > 65535 {
		return fmt.Errorf("--port-base %d: the ports base..base+201 must lie in 1024-65535", base)
	}
	return nil
}

// Lock takes an exclusive flock(2) on path, as `flock -o path cmd` does (the descriptor is
// close-on-exec, so the engines and routers do not hold it), waiting while another
// benchmark holds it. The returned function releases it.
func Lock(ctx context.Context, path string, logw io.Writer) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		// Someone else's lock file: flock(2) works on a read-only descriptor too.
		var rerr error
		if f, rerr = os.Open(path); rerr != nil {
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
	}
	fd := int(f.Fd())
	if err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		fmt.Fprintf(logw, "waiting for %s (another benchmark is running)\n", path)
		got := make(chan error, 1)
		go func() { got <- syscall.Flock(fd, syscall.LOCK_EX) }()
		select {
		case err := <-got:
			if err != nil {
				f.Close()
				return nil, fmt.Errorf("lock %s: %w", path, err)
			}
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		}
	}
	return func() {
		_ = syscall.Flock(fd, syscall.LOCK_UN)
		f.Close()
	}, nil
}

// GitVersion names the checkout at root: its commit, with "+dirty" when tracked files
// outside the paths in exclude (relative to root) differ from it.
func GitVersion(root string, exclude ...string) string {
	out, err := exec.Command("git", "-C", root, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "(unknown commit)"
	}
	v := strings.TrimSpace(string(out))
	args := []string{"-C", root, "status", "--porcelain", "--untracked-files=no", "--", "."}
	for _, e := range exclude {
		args = append(args, ":!"+e)
	}
	if st, err := exec.Command("git", args...).Output(); err == nil && len(st) > 0 {
		v += "+dirty"
	}
	return v
}

// GoBuild builds pkg of the module at root into out.
func GoBuild(ctx context.Context, root, out, pkg string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
	}
	return nil
}

// FindBinary resolves a peer binary: the path given, or name on PATH.
func FindBinary(given, name string) (string, error) {
	if given == "" {
		p, err := exec.LookPath(name)
		if err != nil {
			return "", fmt.Errorf("%s not found on PATH", name)
		}
		return p, nil
	}
	st, err := os.Stat(given)
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return "", fmt.Errorf("%s: %s is not an executable file", name, given)
	}
	return filepath.Abs(given)
}

// BinaryVersion names a peer binary: the commit a versions.txt beside it records for its
// name (hack/build-llmd.sh writes one), else the first 12 hex digits of its SHA-256.
func BinaryVersion(path string) string {
	if path == "" {
		return ""
	}
	name := filepath.Base(path)
	if f, err := os.Open(filepath.Join(filepath.Dir(path), "versions.txt")); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), " "); ok && k == name {
				return strings.TrimSpace(v)
			}
		}
	}
	f, err := os.Open(path)
	if err != nil {
		return "unreadable: " + err.Error()
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "unreadable: " + err.Error()
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))[:12]
}

// Machine describes the host: CPU model, logical cores, kernel, OS and Go.
type Machine struct {
	CPU    string `json:"cpu"`
	Cores  int    `json:"cores"`
	Kernel string `json:"kernel"`
	OS     string `json:"os"`
	Go     string `json:"go"`
}

// ThisMachine reads the host's description (Linux: /proc/cpuinfo, uname).
func ThisMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), OS: runtime.GOOS + "/" + runtime.GOARCH, Go: runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if out, err := exec.Command("uname", "-sr").Output(); err == nil {
		m.Kernel = strings.TrimSpace(string(out))
	}
	return m
}

// String is one line: "CPU, N cores, kernel".
func (m Machine) String() string {
	cpu := m.CPU
	if cpu == "" {
		cpu = "unknown CPU"
	}
	return fmt.Sprintf("%s, %d cores, %s (%s, %s)", cpu, m.Cores, m.Kernel, m.OS, m.Go)
}

// RepoRoot finds the kvrelay checkout from the working directory.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(b), "module github.com/kvrelay/kvrelay\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run from inside the kvrelay checkout (no go.mod of github.com/kvrelay/kvrelay above the working directory)")
		}
		dir = parent
	}
}

// ParseList reads a comma-separated subset of known, returned in known's order (so that
// runs interleave the same way whatever the flag's order) without repeats.
func ParseList(s string, known []string, flagName string) ([]string, error) {
	var out []string
	for x := range strings.SplitSeq(s, ",") {
		x = strings.TrimSpace(x)
		if x == "" {
			continue
		}
		if !slices.Contains(known, x) {
			return nil, fmt.Errorf("%s: unknown %q (known: %s)", flagName, x, strings.Join(known, ", "))
		}
		if !slices.Contains(out, x) {
			out = append(out, x)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: empty", flagName)
	}
	var ordered []string
	for _, k := range known {
		if slices.Contains(out, k) {
			ordered = append(ordered, k)
		}
	}
	return ordered, nil
}

// Without returns xs less the elements drop reports.
func Without(xs []string, drop func(string) bool) []string {
	var out []string
	for _, x := range xs {
		if !drop(x) {
			out = append(out, x)
		}
	}
	return out
}
