package helm_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/yaml"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/internal/kubetest"
	"github.com/kvrelay/kvrelay/internal/testbin"
)

// helmVersion is the helm hack/helm.sh installs; TestHelmScriptVersion keeps the two equal.
const helmVersion = "v3.22.0"

const (
	chart     = "kvrelay" // the chart's directory, beside this file
	release   = "r1"
	namespace = "llm"
	// Object names for release r1 of chart kvrelay.
	cpName        = "r1-kvrelay-controlplane"
	discoveryRBAC = "r1-kvrelay-controlplane-discovery"
	proxyName     = "r1-kvrelay-proxy"
	proxyAdmin    = "r1-kvrelay-proxy-admin"
	tokenSecret   = "r1-kvrelay-api-token"
	xdsSecret     = "r1-kvrelay-xds-tls"
	metricsSecret = "r1-kvrelay-metrics-token"
	tokenReview   = "r1-kvrelay-controlplane-tokenreview"
)

// helmPath is where hack/helm.sh installs helm.
func helmPath() string {
	tools := os.Getenv("KVRELAY_TOOLS")
	if tools == "" {
		home, _ := os.UserHomeDir() // "" then: helm is not found and the tests skip
		tools = filepath.Join(home, ".cache", "kvrelay", "tools")
	}
	return filepath.Join(tools, "helm-"+helmVersion, "helm")
}

// needHelm returns helm's path, or skips t without it (fails it where KVRELAY_HELM_REQUIRE
// is set: CI, where a skip would hide that the chart went untested).
func needHelm(t testing.TB) string {
	t.Helper()
	p := helmPath()
	if _, err := os.Stat(p); err != nil {
		msg := fmt.Sprintf("no helm at %s: run hack/helm.sh to install helm %s", p, helmVersion)
		if os.Getenv("KVRELAY_HELM_REQUIRE") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}

// helmHome holds helm's cache, configuration and data for this test binary (TestMain makes
// and removes it), so that the tests neither read nor write the user's.
var helmHome string

// runHelm runs helm with args in this directory and returns its standard output, or an
// error holding its standard error. Helm's caches and settings live in a directory of the
// test's own, and no kubeconfig is found but one args name.
func runHelm(t testing.TB, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(needHelm(t), args...)
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(helmHome, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(helmHome, "config"),
		"HELM_DATA_HOME="+filepath.Join(helmHome, "data"),
		"KUBECONFIG="+filepath.Join(helmHome, "no-kubeconfig"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

func helm(t testing.TB, args ...string) string {
	t.Helper()
	out, err := runHelm(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// valuesFile writes values (YAML) to a file for helm's -f.
func valuesFile(t testing.TB, values string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(p, []byte(values), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// objects are the documents of a render, each as JSON, by "Kind/namespace/name".
type objects map[string][]byte

// render runs helm template for release r1 in namespace llm with values (YAML; "" for the
// defaults).
func render(t testing.TB, values string) objects {
	t.Helper()
	out, err := renderErr(t, values)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func renderErr(t testing.TB, values string) (objects, error) {
	t.Helper()
	out, err := runHelm(t, "template", release, chart, "--namespace", namespace, "--kube-version", kubetest.Release,
		"-f", valuesFile(t, values))
	if err != nil {
		return nil, err
	}
	return decode(t, out), nil
}

// decode splits helm's output into objects.
func decode(t testing.TB, manifest string) objects {
	t.Helper()
	objs := objects{}
	r := yaml.NewYAMLReader(bufio.NewReader(strings.NewReader(manifest)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		if err != nil {
			t.Fatalf("reading the rendered YAML: %v", err)
		}
		js, err := yaml.ToJSON(doc)
		if err != nil {
			t.Fatalf("rendered YAML: %v\n%s", err, doc)
		}
		if string(js) == "null" { // a document of comments alone
			continue
		}
		var head struct {
			metav1.TypeMeta
			Metadata metav1.ObjectMeta `json:"metadata"`
		}
		if err := json.Unmarshal(js, &head); err != nil {
			t.Fatalf("rendered object: %v\n%s", err, doc)
		}
		if head.Metadata.Namespace == "" && !clusterScoped[head.Kind] {
			t.Errorf("%s %s has no namespace", head.Kind, head.Metadata.Name)
		}
		key := head.Kind + "/" + head.Metadata.Namespace + "/" + head.Metadata.Name
		if _, dup := objs[key]; dup {
			t.Errorf("%s rendered twice", key)
		}
		objs[key] = js
	}
}

// clusterScoped are the kinds the chart renders without a namespace.
var clusterScoped = map[string]bool{"ClusterRoleBinding": true, "ValidatingAdmissionPolicy": true, "ValidatingAdmissionPolicyBinding": true}

// get decodes the object kind ns/name into v strictly (a field the API type lacks, a
// misspelt probe say, fails the test), reporting whether it was rendered.
func (o objects) get(t testing.TB, kind, ns, name string, v any) bool {
	t.Helper()
	js, ok := o[kind+"/"+ns+"/"+name]
	if !ok {
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s %s/%s: %v", kind, ns, name, err)
	}
	return true
}

func (o objects) must(t testing.TB, kind, ns, name string, v any) {
	t.Helper()
	if !o.get(t, kind, ns, name, v) {
		t.Fatalf("no %s %s/%s rendered; have %v", kind, ns, name, o.keys())
	}
}

func (o objects) keys() []string {
	var ks []string
	for k := range o {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// all decodes every object of kind into a new T each.
func all[T any](t testing.TB, o objects, kind string) []*T {
	t.Helper()
	var out []*T
	for _, k := range o.keys() {
		if strings.HasPrefix(k, kind+"/") {
			v := new(T)
			parts := strings.SplitN(k, "/", 3)
			o.must(t, kind, parts[1], parts[2], v)
			out = append(out, v)
		}
	}
	return out
}

// kvrelayFlags lists the flags of kvrelay's controlplane and proxy commands, from their
// --help, as the binary built from this tree prints it: the chart passes no other.
var kvrelayFlags = sync.OnceValues(func() (map[string]map[string]bool, error) {
	bin, err := testbin.Kvrelay()
	if err != nil {
		return nil, err
	}
	flag := regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)`)
	out := map[string]map[string]bool{}
	for _, cmd := range []string{"controlplane", "proxy"} {
		help, err := exec.Command(bin, cmd, "--help").CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("kvrelay %s --help: %w\n%s", cmd, err, help)
		}
		out[cmd] = map[string]bool{}
		for _, m := range flag.FindAllSubmatch(help, -1) {
			out[cmd][string(m[1])] = true
		}
	}
	return out, nil
})

func TestMain(m *testing.M) {
	var err error
	if helmHome, err = os.MkdirTemp("", "kvrelay-helm-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(helmHome)
	testbin.Remove()
	os.Exit(code)
}

// The cache path the tests look in is keyed by the version hack/helm.sh installs. This runs
// without helm.
func TestHelmScriptVersion(t *testing.T) {
	script, err := os.ReadFile("../../helm.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^version=(\S+)$`).FindSubmatch(script)
	if m == nil {
		t.Fatal("hack/helm.sh sets no version=")
	}
	if got := string(m[1]); got != helmVersion {
		t.Fatalf("hack/helm.sh installs helm %s; the tests look for %s", got, helmVersion)
	}
}

// Every value in values.yaml carries a "# --" comment and a row in README.md's table, and
// the table names no value the chart lacks. This runs without helm.
func TestValuesDocumented(t *testing.T) {
	values, err := os.ReadFile(filepath.Join(chart, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(chart, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	documented := documentedValues(t, string(values))
	rows := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([^`]+)` \\|").FindAllStringSubmatch(string(readme), -1) {
		rows[m[1]] = true
		if !documented[m[1]] {
			t.Errorf("README.md lists %s, which values.yaml does not document", m[1])
		}
	}
	for v := range documented {
		if !rows[v] {
			t.Errorf("README.md's table lacks %s", v)
		}
	}
}

// documentedValues returns the dotted paths of the values in values.yaml that a "# --"
// comment documents (their children are documented with them), and fails t for a value
// that no comment on it or above it documents.
func documentedValues(t *testing.T, values string) map[string]bool {
	t.Helper()
	type level struct {
		indent     int
		path       string
		documented bool
	}
	var stack []level
	out := map[string]bool{}
	key := regexp.MustCompile(`^(\s*)([A-Za-z][A-Za-z0-9]*):(.*)$`)
	doc := false // the comment block just above starts with "# --"
	inComment := false
	for _, line := range strings.Split(values, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			if !inComment {
				doc = strings.HasPrefix(trimmed, "# --")
			}
			inComment = true
			continue
		}
		inComment = false
		m := key.FindStringSubmatch(line)
		if m == nil {
			doc = false
			continue
		}
		indent := len(m[1])
		for len(stack) > 0 && stack[len(stack)-1].indent >= indent {
			stack = stack[:len(stack)-1]
		}
		path, parentDoc := m[2], false
		if len(stack) > 0 {
			top := stack[len(stack)-1]
			path, parentDoc = top.path+"."+m[2], top.documented
		}
		switch {
		case parentDoc:
		case doc:
			out[path] = true
		case strings.TrimSpace(m[3]) != "":
			t.Errorf("values.yaml: %s has no \"# --\" comment", path)
		}
		stack = append(stack, level{indent, path, parentDoc || doc})
		doc = false
	}
	if len(out) == 0 {
		t.Fatal("values.yaml documents no value")
	}
	return out
}

// templateCases are the sets of values the chart is linted and rendered with.
var templateCases = []struct {
	name   string
	values string
	check  func(t *testing.T, o objects)
}{
	{
		name: "defaults",
		check: func(t *testing.T, o objects) {
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			if r := cp.Spec.Replicas; r == nil || *r != 2 {
				t.Errorf("control plane replicas %v, want 2", r)
			}
			c := container(t, &cp, "controlplane")
			wantArgs(t, c, "controlplane", "--store=kubernetes", "--store-name=r1-kvrelay", "--leader-elect", "--leader-elect-lease=kvrelay-controlplane",
				"--xds-listen=0.0.0.0:18000", "--xds-cert=/etc/kvrelay/xds-tls/tls.crt", "--xds-key=/etc/kvrelay/xds-tls/tls.key",
				"--xds-kube-auth=llm/"+proxyName, "--xds-kube-audience=kvrelay-xds", "--api-listen=0.0.0.0:18080",
				"--k8s-namespace=llm", "--k8s-selector=app=vllm", "--k8s-worker=engine=vllm,kv-events=tcp://*:5557")
			noArgs(t, c, "--xds-insecure")
			// A follower forwards changes to the leader at the address it shares.
			wantArgs(t, c, "--api-advertise=$(POD_IP):18080", "--api-peer-ca=/etc/kvrelay/xds-tls/ca.crt", "--api-peer-server-name="+cpName+".llm.svc")
			for env, field := range map[string]string{"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP", "POD_UID": "metadata.uid"} {
				if got := envField(c, env); got != field {
					t.Errorf("control plane env %s from %q, want the downward API's %s", env, got, field)
				}
			}
			probe(t, "control plane readiness", c.ReadinessProbe, "/readyz", "api")
			probe(t, "control plane liveness", c.LivenessProbe, "/healthz", "api")
			// The operator API is HTTPS with the xDS certificate.
			wantArgs(t, c, "--api-cert=/etc/kvrelay/xds-tls/tls.crt", "--api-key=/etc/kvrelay/xds-tls/tls.key")
			for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe} {
				if p.HTTPGet.Scheme != corev1.URISchemeHTTPS {
					t.Errorf("control plane probe %s over %q, want HTTPS", p.HTTPGet.Path, p.HTTPGet.Scheme)
				}
			}
			noArgs(t, c, "--data-dir")
			if m := mountOf(t, &cp, c, argValue(c, "--api-token-file")); m.Secret == nil || m.Secret.SecretName != tokenSecret {
				t.Errorf("--api-token-file is on volume %+v, want Secret %s", m.VolumeSource, tokenSecret)
			}
			// /metrics beyond loopback wants a token: a read-only one of its own.
			if m := mountOf(t, &cp, c, argValue(c, "--metrics-token-file")); m.Secret == nil || m.Secret.SecretName != metricsSecret {
				t.Errorf("--metrics-token-file is on volume %+v, want Secret %s", m.VolumeSource, metricsSecret)
			}
			var ms corev1.Secret
			o.must(t, "Secret", namespace, metricsSecret, &ms)
			if tok := ms.Data["token"]; len(tok) != 32 {
				t.Errorf("generated metrics token %q, want 32 characters", tok)
			}
			if a := cp.Spec.Template.Spec.Affinity; a == nil || a.PodAntiAffinity == nil ||
				len(a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 ||
				a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].PodAffinityTerm.TopologyKey != corev1.LabelHostname ||
				len(a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 0 {
				t.Errorf("control plane affinity %+v, want soft anti-affinity by %s", a, corev1.LabelHostname)
			}

			var pdb policyv1.PodDisruptionBudget
			o.must(t, "PodDisruptionBudget", namespace, cpName, &pdb)
			if m := pdb.Spec.MinAvailable; m == nil || m.IntValue() != 1 {
				t.Errorf("control plane PDB minAvailable %v, want 1", m)
			}

			var lease rbacv1.Role
			o.must(t, "Role", namespace, cpName, &lease)
			wantRule(t, lease, "coordination.k8s.io", "leases", "get", "create", "update")
			// The shared state (--store kubernetes): every replica watches it, the leader
			// writes it; each replica shares what it alone sees in KvrelayShares, and deletes
			// the parts of its shares' earlier writes in one request.
			for _, r := range registry.WatchedResources {
				wantRule(t, lease, r.Group, r.Resource, "get", "list", "watch", "create", "update", "delete")
			}
			wantRule(t, lease, "kvrelay.io", "kvrelaypolicies/status", "update")
			wantRule(t, lease, "kvrelay.io", "kvrelayshares", "get", "list", "create", "update", "deletecollection")
			var disc rbacv1.Role
			o.must(t, "Role", namespace, discoveryRBAC, &disc)
			wantRule(t, disc, "discovery.k8s.io", "endpointslices", "get", "list", "watch")
			if len(disc.Rules) != 1 {
				t.Errorf("discovery Role rules %+v: without the planner, endpointslices alone (no scale, no pod patch)", disc.Rules)
			}

			var px appsv1.Deployment
			o.must(t, "Deployment", namespace, proxyName, &px)
			if px.Spec.Replicas != nil {
				t.Errorf("proxy replicas %d set under the autoscaler", *px.Spec.Replicas)
			}
			pc := container(t, &px, "proxy")
			wantArgs(t, pc, "proxy", "--xds="+cpName+".llm.svc:18000", "--xds-ca=/etc/kvrelay/xds-tls/ca.crt",
				"--xds-token-file=/var/run/secrets/kvrelay/xds-token/token",
				"--node-id=$(POD_NAME)", "--listen=0.0.0.0:8080", "--admin-listen=0.0.0.0:9090", "--policy=latency")
			noArgs(t, pc, "--xds-insecure")
			noArgs(t, pc, "--api-keys-file")
			checkXDSAuth(t, o, &cp, c, &px, pc)
			if got := envField(pc, "POD_NAME"); got != "metadata.name" {
				t.Errorf("proxy env POD_NAME from %q, want metadata.name", got)
			}
			probe(t, "proxy readiness", pc.ReadinessProbe, "/health", "http")
			if px.Spec.Template.Spec.AutomountServiceAccountToken == nil || *px.Spec.Template.Spec.AutomountServiceAccountToken {
				t.Error("proxy pods mount a ServiceAccount token they never use")
			}

			var hpa autoscalingv2.HorizontalPodAutoscaler
			o.must(t, "HorizontalPodAutoscaler", namespace, proxyName, &hpa)
			if len(hpa.Spec.Metrics) != 1 || hpa.Spec.Metrics[0].Resource == nil || hpa.Spec.Metrics[0].Resource.Name != corev1.ResourceCPU {
				t.Errorf("HPA metrics %+v, want CPU alone", hpa.Spec.Metrics)
			}

			var sec corev1.Secret
			o.must(t, "Secret", namespace, tokenSecret, &sec)
			if tok := sec.Data["token"]; len(tok) != 32 {
				t.Errorf("generated API token %q, want 32 characters", tok)
			}
			for name, port := range map[string]int32{proxyName: 8080, proxyAdmin: 9090, cpName: 18000} {
				var svc corev1.Service
				o.must(t, "Service", namespace, name, &svc)
				if !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Port == port }) {
					t.Errorf("Service %s ports %+v, want %d", name, svc.Spec.Ports, port)
				}
			}
			if sm := all[map[string]any](t, o, "ServiceMonitor"); len(sm) != 0 {
				t.Errorf("%d ServiceMonitors by default, want none", len(sm))
			}
		},
	},
	{
		name: "one replica without leader election",
		values: `
controlplane:
  replicas: 1
  leaderElection: {enabled: false}
  store: bolt
`,
		check: func(t *testing.T, o objects) {
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			if r := cp.Spec.Replicas; r == nil || *r != 1 {
				t.Errorf("control plane replicas %v, want 1", r)
			}
			c := container(t, &cp, "controlplane")
			noArgs(t, c, "--leader-elect")
			noArgs(t, c, "--store")
			if m := mountOf(t, &cp, c, argValue(c, "--data-dir")); m.EmptyDir == nil {
				t.Errorf("--data-dir is on volume %+v, want an emptyDir", m)
			}
			for _, kind := range []string{"Role", "RoleBinding", "PodDisruptionBudget"} {
				if o.get(t, kind, namespace, cpName, new(map[string]any)) {
					t.Errorf("%s %s rendered for one replica without leader election", kind, cpName)
				}
			}
			// Discovery needs its Role all the same, and the proxies keep theirs.
			o.must(t, "Role", namespace, discoveryRBAC, new(rbacv1.Role))
			o.must(t, "PodDisruptionBudget", namespace, proxyName, new(policyv1.PodDisruptionBudget))
		},
	},
	{
		name: "in-flight autoscaling",
		values: `
proxy:
  autoscaling:
    maxReplicas: 20
    inflight: {enabled: true, averageValue: "48"}
`,
		check: func(t *testing.T, o objects) {
			var hpa autoscalingv2.HorizontalPodAutoscaler
			o.must(t, "HorizontalPodAutoscaler", namespace, proxyName, &hpa)
			if hpa.Spec.MaxReplicas != 20 || len(hpa.Spec.Metrics) != 2 {
				t.Fatalf("HPA %+v, want 20 replicas at most on two metrics", hpa.Spec)
			}
			m := hpa.Spec.Metrics[1]
			if m.Type != autoscalingv2.PodsMetricSourceType || m.Pods == nil ||
				m.Pods.Metric.Name != "kvrelay_proxy_inflight_requests" ||
				m.Pods.Target.Type != autoscalingv2.AverageValueMetricType || m.Pods.Target.AverageValue.String() != "48" {
				t.Errorf("HPA second metric %+v, want Pods kvrelay_proxy_inflight_requests averaging 48", m)
			}
		},
	},
	{
		name: "fixed proxies",
		values: `
proxy:
  replicas: 3
  autoscaling: {enabled: false}
  podDisruptionBudget: {enabled: false}
`,
		check: func(t *testing.T, o objects) {
			var px appsv1.Deployment
			o.must(t, "Deployment", namespace, proxyName, &px)
			if r := px.Spec.Replicas; r == nil || *r != 3 {
				t.Errorf("proxy replicas %v, want 3", r)
			}
			if o.get(t, "HorizontalPodAutoscaler", namespace, proxyName, new(map[string]any)) {
				t.Error("HPA rendered with autoscaling off")
			}
			if o.get(t, "PodDisruptionBudget", namespace, proxyName, new(map[string]any)) {
				t.Error("proxy PDB rendered while disabled")
			}
		},
	},
	{
		name: "service monitors",
		values: `
serviceMonitor:
  enabled: true
  interval: 15s
  labels: {release: prometheus}
`,
		check: func(t *testing.T, o objects) {
			svcs := all[corev1.Service](t, o, "Service")
			for name, port := range map[string]string{cpName: "api", proxyName: "admin"} {
				var sm struct {
					metav1.TypeMeta
					Metadata metav1.ObjectMeta `json:"metadata"`
					Spec     struct {
						Selector  metav1.LabelSelector `json:"selector"`
						Endpoints []struct {
							Port, Path, Interval, Scheme string
							Authorization                *struct {
								Type        string
								Credentials struct{ Name, Key string }
							}
							TLSConfig *struct {
								ServerName string `json:"serverName"`
								CA         struct {
									Secret struct{ Name, Key string } `json:"secret"`
								} `json:"ca"`
							} `json:"tlsConfig"`
						} `json:"endpoints"`
					} `json:"spec"`
				}
				o.must(t, "ServiceMonitor", namespace, name, &sm)
				if sm.APIVersion != "monitoring.coreos.com/v1" || sm.Metadata.Labels["release"] != "prometheus" {
					t.Errorf("ServiceMonitor %s: %s, labels %v", name, sm.APIVersion, sm.Metadata.Labels)
				}
				if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != port ||
					sm.Spec.Endpoints[0].Path != "/metrics" || sm.Spec.Endpoints[0].Interval != "15s" {
					t.Errorf("ServiceMonitor %s endpoints %+v, want port %s /metrics every 15s", name, sm.Spec.Endpoints, port)
				}
				// The control plane's port is HTTPS (controlplane.apiTLS), its CA the chart's.
				if e := sm.Spec.Endpoints[0]; name == cpName && (e.Scheme != "https" || e.TLSConfig == nil ||
					e.TLSConfig.ServerName != cpName+"."+namespace+".svc" || e.TLSConfig.CA.Secret.Name != xdsSecret || e.TLSConfig.CA.Secret.Key != "ca.crt") {
					t.Errorf("ServiceMonitor %s endpoint %+v, want https verified by %s's ca.crt", name, e, xdsSecret)
				} else if name != cpName && (e.Scheme != "" || e.TLSConfig != nil) {
					t.Errorf("ServiceMonitor %s endpoint %+v, want plain HTTP", name, e)
				}
				if e := sm.Spec.Endpoints[0]; name == cpName && (e.Authorization == nil || e.Authorization.Type != "Bearer" ||
					e.Authorization.Credentials.Name != metricsSecret || e.Authorization.Credentials.Key != "token") {
					t.Errorf("ServiceMonitor %s authorization %+v, want the Bearer token of Secret %s", name, e.Authorization, metricsSecret)
				}
				// It must find a Service with that port: the one Prometheus scrapes.
				sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.ContainsFunc(svcs, func(s *corev1.Service) bool {
					return sel.Matches(labels.Set(s.Labels)) && slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == port })
				}) {
					t.Errorf("ServiceMonitor %s selects no Service with port %s", name, port)
				}
			}
		},
	},
	{
		name: "existing API token secret",
		values: `
apiToken: {existingSecret: ops-token, existingSecretKey: bearer}
`,
		check: func(t *testing.T, o objects) {
			if o.get(t, "Secret", namespace, tokenSecret, &corev1.Secret{}) {
				t.Errorf("Secret %s rendered beside an existing one", tokenSecret)
			}
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			c := container(t, &cp, "controlplane")
			file := argValue(c, "--api-token-file")
			v := mountOf(t, &cp, c, file)
			if v.Secret == nil || v.Secret.SecretName != "ops-token" || len(v.Secret.Items) != 1 ||
				v.Secret.Items[0].Key != "bearer" || !strings.HasSuffix(file, "/"+v.Secret.Items[0].Path) {
				t.Errorf("--api-token-file %s on %+v, want key bearer of Secret ops-token", file, v.VolumeSource)
			}
		},
	},
	{
		name: "API keys from a Secret",
		values: `
proxy:
  apiKeys: {secretName: llm-api-keys, secretKey: tenants}
`,
		check: func(t *testing.T, o objects) {
			var px appsv1.Deployment
			o.must(t, "Deployment", namespace, proxyName, &px)
			pc := container(t, &px, "proxy")
			file := argValue(pc, "--api-keys-file")
			if file == "" {
				t.Fatalf("proxy args %q lack --api-keys-file", pc.Args)
			}
			v := mountOf(t, &px, pc, file)
			if v.Secret == nil || v.Secret.SecretName != "llm-api-keys" || len(v.Secret.Items) != 1 ||
				v.Secret.Items[0].Key != "tenants" || !strings.HasSuffix(file, "/"+v.Secret.Items[0].Path) {
				t.Errorf("--api-keys-file %s on %+v, want key tenants of Secret llm-api-keys", file, v.VolumeSource)
			}
			// Read-only, and the directory rather than the file alone (subPath): the kubelet
			// swaps a Secret's updates into a directory, never into a subPath mount.
			for _, m := range pc.VolumeMounts {
				if m.Name == v.Name && (!m.ReadOnly || m.SubPath != "" || path.Join(m.MountPath, v.Secret.Items[0].Path) != file) {
					t.Errorf("the keys file's mount %+v, want the Secret's directory read-only, holding %s", m, file)
				}
			}
		},
	},
	{
		name: "xDS over TLS",
		values: `
xds: {tlsSecret: xds-tls}
`,
		check: func(t *testing.T, o objects) {
			var cp, px appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			o.must(t, "Deployment", namespace, proxyName, &px)
			c, pc := container(t, &cp, "controlplane"), container(t, &px, "proxy")
			for _, flag := range []string{"--xds-cert", "--xds-key"} {
				if v := mountOf(t, &cp, c, argValue(c, flag)); v.Secret == nil || v.Secret.SecretName != "xds-tls" {
					t.Errorf("control plane %s on %+v, want Secret xds-tls", flag, v.VolumeSource)
				}
			}
			v := mountOf(t, &px, pc, argValue(pc, "--xds-ca"))
			if v.Secret == nil || v.Secret.SecretName != "xds-tls" || len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "ca.crt" {
				t.Errorf("proxy --xds-ca on %+v, want ca.crt alone of Secret xds-tls", v.VolumeSource)
			}
			noArgs(t, pc, "--xds-insecure")
			if o.get(t, "Secret", namespace, xdsSecret, &corev1.Secret{}) {
				t.Errorf("Secret %s generated beside xds.tlsSecret", xdsSecret)
			}
		},
	},
	{
		name: "xDS certificate from cert-manager",
		values: `
xds: {certManagerIssuer: {name: fleet-ca, kind: ClusterIssuer}}
`,
		check: func(t *testing.T, o objects) {
			var cert struct {
				metav1.TypeMeta
				Metadata metav1.ObjectMeta `json:"metadata"`
				Spec     struct {
					SecretName string                             `json:"secretName"`
					DNSNames   []string                           `json:"dnsNames"`
					Usages     []string                           `json:"usages"`
					IssuerRef  struct{ Name, Kind, Group string } `json:"issuerRef"`
				} `json:"spec"`
			}
			o.must(t, "Certificate", namespace, xdsSecret, &cert)
			if cert.Spec.SecretName != xdsSecret || !slices.Contains(cert.Spec.DNSNames, cpName+"."+namespace+".svc") ||
				cert.Spec.IssuerRef.Name != "fleet-ca" || cert.Spec.IssuerRef.Kind != "ClusterIssuer" || cert.Spec.IssuerRef.Group != "cert-manager.io" ||
				!slices.Equal(cert.Spec.Usages, []string{"server auth"}) {
				t.Errorf("Certificate %+v", cert.Spec)
			}
			if o.get(t, "Secret", namespace, xdsSecret, &corev1.Secret{}) {
				t.Errorf("Secret %s generated beside cert-manager's", xdsSecret)
			}
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			c := container(t, &cp, "controlplane")
			if v := mountOf(t, &cp, c, argValue(c, "--xds-cert")); v.Secret == nil || v.Secret.SecretName != xdsSecret {
				t.Errorf("--xds-cert on %+v, want cert-manager's Secret %s", v.VolumeSource, xdsSecret)
			}
		},
	},
	{
		name: "xDS without proxy credentials",
		values: `
xds: {auth: none}
`,
		check: func(t *testing.T, o objects) {
			var cp, px appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			o.must(t, "Deployment", namespace, proxyName, &px)
			c, pc := container(t, &cp, "controlplane"), container(t, &px, "proxy")
			wantArgs(t, c, "--xds-insecure", "--xds-cert=/etc/kvrelay/xds-tls/tls.crt")
			noArgs(t, c, "--xds-kube-auth")
			noArgs(t, pc, "--xds-token-file")
			if o.get(t, "ClusterRoleBinding", "", tokenReview, &rbacv1.ClusterRoleBinding{}) {
				t.Error("TokenReview granted without xds.auth serviceAccountToken")
			}
		},
	},
	{
		name: "operator API over plain HTTP",
		values: `
controlplane: {apiTLS: false}
`,
		check: func(t *testing.T, o objects) {
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			c := container(t, &cp, "controlplane")
			noArgs(t, c, "--api-cert")
			noArgs(t, c, "--api-key")
			if s := c.ReadinessProbe.HTTPGet.Scheme; s != "" && s != corev1.URISchemeHTTP {
				t.Errorf("readiness probe over %s, want HTTP", s)
			}
		},
	},
	{
		name: "engines in another namespace with the planner",
		values: `
discovery: {namespace: engines, selector: "app=vllm,tier in (a,b)"}
controlplane:
  extraArgs: [--planner, --planner-profile=/profiles/h100.json, --planner-deployment=both=vllm]
  extraVolumes: [{name: profiles, configMap: {name: vllm-profile}}]
  extraVolumeMounts: [{name: profiles, mountPath: /profiles}]
`,
		check: func(t *testing.T, o objects) {
			var disc rbacv1.Role
			o.must(t, "Role", "engines", discoveryRBAC, &disc)
			wantRule(t, disc, "apps", "deployments/scale", "get", "update", "patch")
			wantRule(t, disc, "", "pods", "list", "patch")
			var rb rbacv1.RoleBinding
			o.must(t, "RoleBinding", "engines", discoveryRBAC, &rb)
			if len(rb.Subjects) != 1 || rb.Subjects[0].Namespace != namespace || rb.Subjects[0].Name != cpName {
				t.Errorf("discovery RoleBinding subjects %+v, want ServiceAccount %s/%s", rb.Subjects, namespace, cpName)
			}
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			c := container(t, &cp, "controlplane")
			wantArgs(t, c, "--k8s-namespace=engines", "--k8s-selector=app=vllm,tier in (a,b)",
				"--planner", "--planner-profile=/profiles/h100.json", "--planner-deployment=both=vllm")
			if v := mountOf(t, &cp, c, "/profiles/h100.json"); v.ConfigMap == nil || v.ConfigMap.Name != "vllm-profile" {
				t.Errorf("planner profile on %+v, want ConfigMap vllm-profile", v.VolumeSource)
			}
		},
	},
	{
		name: "an InferencePool's pods",
		values: `
discovery: {inferencePool: gpt-oss}
controlplane: {plannerRBAC: false}
`,
		check: func(t *testing.T, o objects) {
			var cp appsv1.Deployment
			o.must(t, "Deployment", namespace, cpName, &cp)
			c := container(t, &cp, "controlplane")
			wantArgs(t, c, "controlplane", "--k8s-inference-pool=gpt-oss")
			if slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--k8s-selector") }) {
				t.Errorf("control plane args %v carry --k8s-selector beside the InferencePool", c.Args)
			}
			var disc rbacv1.Role
			o.must(t, "Role", namespace, discoveryRBAC, &disc)
			wantRule(t, disc, "inference.networking.k8s.io", "inferencepools", "get", "list", "watch")
			wantRule(t, disc, "", "pods", "get", "list", "watch")
			if len(disc.Rules) != 2 {
				t.Errorf("discovery Role rules %+v, want the pool's and its pods'", disc.Rules)
			}
		},
	},
	{
		name: "no planner RBAC",
		values: `
controlplane: {plannerRBAC: false}
`,
		check: func(t *testing.T, o objects) {
			var disc rbacv1.Role
			o.must(t, "Role", namespace, discoveryRBAC, &disc)
			if len(disc.Rules) != 1 || disc.Rules[0].Resources[0] != "endpointslices" {
				t.Errorf("discovery Role rules %+v, want endpointslices alone", disc.Rules)
			}
		},
	},
}

func TestLint(t *testing.T) {
	needHelm(t)
	for _, tc := range templateCases {
		t.Run(tc.name, func(t *testing.T) {
			helm(t, "lint", "--strict", chart, "--namespace", namespace, "--kube-version", kubetest.Release, "-f", valuesFile(t, tc.values))
		})
	}
}

func TestTemplate(t *testing.T) {
	needHelm(t)
	for _, tc := range templateCases {
		t.Run(tc.name, func(t *testing.T) {
			o := render(t, tc.values)
			checkConsistent(t, o)
			tc.check(t, o)
		})
	}
}

// Replicas of a control plane without leader election would each make changes: the chart
// refuses to render them.
func TestTemplateRefusesReplicasWithoutLeader(t *testing.T) {
	needHelm(t)
	_, err := renderErr(t, "controlplane: {replicas: 2, leaderElection: {enabled: false}}\n")
	if err == nil || !strings.Contains(err.Error(), "controlplane.leaderElection.enabled") {
		t.Fatalf("render of 2 replicas without leader election: %v; want it refused", err)
	}
}

// Replicas that each keep their own bbolt state would each route by their own policy, and a
// store the control plane does not know is a typo: the chart refuses both.
func TestTemplateRefusesReplicasWithoutSharedState(t *testing.T) {
	needHelm(t)
	for values, want := range map[string]string{
		"controlplane: {replicas: 2, store: bolt}\n": "controlplane.store kubernetes",
		"controlplane: {store: etcd}\n":              "want kubernetes or bolt",
	} {
		if _, err := renderErr(t, values); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("render of %q: %v; want it refused (%s)", values, err, want)
		}
	}
}

// checkConsistent checks what every render must hold: the objects refer to one another
// (selectors, ports, volumes, roles, the HPA's and PDBs' targets), the containers are locked
// down, and every flag passed is one the kvrelay binary of this tree has.
func checkConsistent(t *testing.T, o objects) {
	t.Helper()
	deployments := all[appsv1.Deployment](t, o, "Deployment")
	podsOf := func(sel labels.Selector) []*appsv1.Deployment {
		var ds []*appsv1.Deployment
		for _, d := range deployments {
			if sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				ds = append(ds, d)
			}
		}
		return ds
	}
	flags, flagsErr := kvrelayFlags()
	if flagsErr != nil {
		t.Errorf("kvrelay's flags: %v", flagsErr)
	}
	for _, d := range deployments {
		sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
		if err != nil || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
			t.Errorf("Deployment %s: selector %v does not match its pods %v (%v)", d.Name, d.Spec.Selector, d.Spec.Template.Labels, err)
		}
		if len(podsOf(sel)) != 1 {
			t.Errorf("Deployment %s: selector matches %d Deployments' pods", d.Name, len(podsOf(sel)))
		}
		ps := d.Spec.Template.Spec
		if sc := ps.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
			t.Errorf("Deployment %s: pods may run as root", d.Name)
		}
		volumes := map[string]bool{}
		for _, v := range ps.Volumes {
			volumes[v.Name] = true
		}
		for _, c := range ps.Containers {
			if c.Image != "ghcr.io/kvrelay/kvrelay:0.1.0" {
				t.Errorf("%s: image %s, want the chart's appVersion as tag", c.Name, c.Image)
			}
			sc := c.SecurityContext
			if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
				sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
				t.Errorf("%s: security context %+v, want a read-only root, no escalation, all capabilities dropped", c.Name, sc)
			}
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
				t.Errorf("%s: resources %+v, want a CPU request and a memory limit", c.Name, c.Resources)
			}
			for _, m := range c.VolumeMounts {
				if !volumes[m.Name] {
					t.Errorf("%s: mount of volume %s, which the pod lacks", c.Name, m.Name)
				}
			}
			if flags == nil || len(c.Args) == 0 {
				continue
			}
			known := flags[c.Args[0]]
			if known == nil {
				t.Errorf("%s: runs kvrelay %s, not controlplane or proxy", c.Name, c.Args[0])
				continue
			}
			for _, a := range c.Args[1:] {
				name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				if !strings.HasPrefix(a, "--") || !known[name] {
					t.Errorf("%s: argument %q is no flag of kvrelay %s", c.Name, a, c.Args[0])
				}
			}
		}
	}
	for _, s := range all[corev1.Service](t, o, "Service") {
		ds := podsOf(labels.SelectorFromSet(s.Spec.Selector))
		if len(s.Spec.Selector) == 0 || len(ds) != 1 {
			t.Errorf("Service %s selects %d Deployments' pods, want 1", s.Name, len(ds))
			continue
		}
		for _, p := range s.Spec.Ports {
			if !slices.ContainsFunc(ds[0].Spec.Template.Spec.Containers, func(c corev1.Container) bool {
				return slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool { return cp.Name == p.TargetPort.String() })
			}) {
				t.Errorf("Service %s: target port %s is no port of %s", s.Name, p.TargetPort.String(), ds[0].Name)
			}
		}
	}
	for _, p := range all[policyv1.PodDisruptionBudget](t, o, "PodDisruptionBudget") {
		sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
		if err != nil || len(podsOf(sel)) != 1 {
			t.Errorf("PDB %s selects %d Deployments' pods (%v)", p.Name, len(podsOf(sel)), err)
		}
	}
	for _, h := range all[autoscalingv2.HorizontalPodAutoscaler](t, o, "HorizontalPodAutoscaler") {
		ref := h.Spec.ScaleTargetRef
		if ref.Kind != "Deployment" || !o.get(t, "Deployment", h.Namespace, ref.Name, new(appsv1.Deployment)) {
			t.Errorf("HPA %s scales %s %s, which is not rendered", h.Name, ref.Kind, ref.Name)
		}
	}
	for _, rb := range all[rbacv1.RoleBinding](t, o, "RoleBinding") {
		if !o.get(t, "Role", rb.Namespace, rb.RoleRef.Name, new(rbacv1.Role)) {
			t.Errorf("RoleBinding %s/%s binds Role %s, which is not rendered there", rb.Namespace, rb.Name, rb.RoleRef.Name)
		}
		for _, s := range rb.Subjects {
			if s.Kind != rbacv1.ServiceAccountKind || !o.get(t, "ServiceAccount", s.Namespace, s.Name, new(corev1.ServiceAccount)) {
				t.Errorf("RoleBinding %s/%s binds %s %s/%s, which is not rendered", rb.Namespace, rb.Name, s.Kind, s.Namespace, s.Name)
			}
		}
	}
}

// checkXDSAuth checks the defaults' xDS credentials: the control plane serves TLS from the
// generated Secret, for the name the proxies dial, and reviews tokens (system:auth-delegator);
// each proxy runs as the proxies' ServiceAccount and reads a token projected for the xDS
// audience alone, and no API server token.
func checkXDSAuth(t *testing.T, o objects, cp *appsv1.Deployment, c *corev1.Container, px *appsv1.Deployment, pc *corev1.Container) {
	t.Helper()
	var sec corev1.Secret
	o.must(t, "Secret", namespace, xdsSecret, &sec)
	if sec.Type != corev1.SecretTypeTLS {
		t.Errorf("Secret %s type %s, want %s", xdsSecret, sec.Type, corev1.SecretTypeTLS)
	}
	caBlock, _ := pem.Decode(sec.Data["ca.crt"])
	certBlock, _ := pem.Decode(sec.Data["tls.crt"])
	if caBlock == nil || certBlock == nil {
		t.Fatalf("Secret %s: ca.crt or tls.crt is not PEM", xdsSecret)
	}
	ca, err := x509.ParseCertificate(caBlock.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(certBlock.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tls.X509KeyPair(sec.Data["tls.crt"], sec.Data["tls.key"]); err != nil {
		t.Errorf("Secret %s: tls.crt and tls.key do not pair: %v", xdsSecret, err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	host := cpName + "." + namespace + ".svc"
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, DNSName: host}); err != nil {
		t.Errorf("the xDS certificate does not verify for %s against ca.crt: %v", host, err)
	}
	for _, flag := range []string{"--xds-cert", "--xds-key"} {
		if v := mountOf(t, cp, c, argValue(c, flag)); v.Secret == nil || v.Secret.SecretName != xdsSecret {
			t.Errorf("control plane %s on %+v, want Secret %s", flag, v.VolumeSource, xdsSecret)
		}
	}
	if v := mountOf(t, px, pc, argValue(pc, "--xds-ca")); v.Secret == nil || v.Secret.SecretName != xdsSecret || len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "ca.crt" {
		t.Errorf("proxy --xds-ca on %+v, want ca.crt alone of Secret %s", v.VolumeSource, xdsSecret)
	}
	v := mountOf(t, px, pc, argValue(pc, "--xds-token-file"))
	if v.Projected == nil || len(v.Projected.Sources) != 1 || v.Projected.Sources[0].ServiceAccountToken == nil ||
		v.Projected.Sources[0].ServiceAccountToken.Audience != "kvrelay-xds" || !strings.HasSuffix(argValue(pc, "--xds-token-file"), "/"+v.Projected.Sources[0].ServiceAccountToken.Path) {
		t.Errorf("proxy --xds-token-file on %+v, want a ServiceAccount token projected for audience kvrelay-xds", v.VolumeSource)
	}
	if sa := px.Spec.Template.Spec.ServiceAccountName; sa != proxyName {
		t.Errorf("proxy pods run as ServiceAccount %q, want %s", sa, proxyName)
	}
	o.must(t, "ServiceAccount", namespace, proxyName, &corev1.ServiceAccount{})
	var crb rbacv1.ClusterRoleBinding
	o.must(t, "ClusterRoleBinding", "", tokenReview, &crb)
	if crb.RoleRef.Kind != "ClusterRole" || crb.RoleRef.Name != "system:auth-delegator" || len(crb.Subjects) != 1 ||
		crb.Subjects[0].Name != cpName || crb.Subjects[0].Namespace != namespace {
		t.Errorf("TokenReview binding %+v, want system:auth-delegator for ServiceAccount %s/%s", crb, namespace, cpName)
	}
}

func container(t *testing.T, d *appsv1.Deployment, name string) *corev1.Container {
	t.Helper()
	for i := range d.Spec.Template.Spec.Containers {
		if c := &d.Spec.Template.Spec.Containers[i]; c.Name == name {
			return c
		}
	}
	t.Fatalf("Deployment %s has no container %s", d.Name, name)
	return nil
}

func wantArgs(t *testing.T, c *corev1.Container, want ...string) {
	t.Helper()
	for _, w := range want {
		if !slices.Contains(c.Args, w) {
			t.Errorf("%s args %q lack %q", c.Name, c.Args, w)
		}
	}
}

func noArgs(t *testing.T, c *corev1.Container, flag string) {
	t.Helper()
	if slices.ContainsFunc(c.Args, func(a string) bool { return a == flag || strings.HasPrefix(a, flag+"=") }) {
		t.Errorf("%s args %q hold %s", c.Name, c.Args, flag)
	}
}

// argValue is the value of --flag=value in c's arguments, "" without one.
func argValue(c *corev1.Container, flag string) string {
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
	}
	return ""
}

// envField is the downward API field that c's env var name comes from.
func envField(c *corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			return e.ValueFrom.FieldRef.FieldPath
		}
	}
	return ""
}

// mountOf returns the volume that holds path in c, failing t if none does.
func mountOf(t *testing.T, d *appsv1.Deployment, c *corev1.Container, path string) corev1.Volume {
	t.Helper()
	var best *corev1.VolumeMount
	for i, m := range c.VolumeMounts {
		if (path == m.MountPath || strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/")) &&
			(best == nil || len(m.MountPath) > len(best.MountPath)) {
			best = &c.VolumeMounts[i]
		}
	}
	if best == nil {
		t.Fatalf("%s: no volume holds %q", c.Name, path)
	}
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Name == best.Name {
			return v
		}
	}
	t.Fatalf("%s: no volume %s", d.Name, best.Name)
	return corev1.Volume{}
}

func probe(t *testing.T, what string, p *corev1.Probe, path, port string) {
	t.Helper()
	if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != path || p.HTTPGet.Port.String() != port {
		t.Errorf("%s probe %+v, want HTTP GET %s on port %s", what, p, path, port)
	}
}

// wantRule checks that r grants exactly verbs on group/resource.
func wantRule(t *testing.T, r rbacv1.Role, group, resource string, verbs ...string) {
	t.Helper()
	for _, rule := range r.Rules {
		if slices.Contains(rule.APIGroups, group) && slices.Contains(rule.Resources, resource) {
			got := slices.Sorted(slices.Values(rule.Verbs))
			if !slices.Equal(got, slices.Sorted(slices.Values(verbs))) {
				t.Errorf("Role %s grants %v on %s, want %v", r.Name, got, resource, verbs)
			}
			return
		}
	}
	t.Errorf("Role %s grants nothing on %s.%s", r.Name, resource, group)
}

// TestNetworkPolicies: by default the control plane's xDS port admits only the release's
// proxies, its API port the release's namespace and the monitoring namespace, and the
// proxies' admin port only the monitoring namespace, their OpenAI port anyone; disabled,
// none is rendered.
func TestNetworkPolicies(t *testing.T) {
	needHelm(t)
	o := render(t, "")
	var cp, px networkingv1.NetworkPolicy
	o.must(t, "NetworkPolicy", namespace, cpName, &cp)
	o.must(t, "NetworkPolicy", namespace, proxyName, &px)
	rule := func(p networkingv1.NetworkPolicy, port string) *networkingv1.NetworkPolicyIngressRule {
		for i, r := range p.Spec.Ingress {
			for _, pp := range r.Ports {
				if pp.Port != nil && pp.Port.String() == port {
					return &p.Spec.Ingress[i]
				}
			}
		}
		t.Fatalf("%s: no rule for port %s", p.Name, port)
		return nil
	}
	if r := rule(cp, "xds"); len(r.From) != 1 || r.From[0].PodSelector == nil || r.From[0].PodSelector.MatchLabels["app.kubernetes.io/component"] != "proxy" || r.From[0].NamespaceSelector != nil {
		t.Errorf("xDS admits %+v, want the release's proxies alone", r.From)
	}
	monitoring := func(f networkingv1.NetworkPolicyPeer) bool {
		return f.NamespaceSelector != nil && f.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] == "monitoring"
	}
	if r := rule(cp, "api"); len(r.From) != 2 || r.From[0].PodSelector == nil || len(r.From[0].PodSelector.MatchLabels) != 0 || !monitoring(r.From[1]) {
		t.Errorf("the API admits %+v, want the release's namespace and monitoring", r.From)
	}
	if r := rule(px, "admin"); len(r.From) != 1 || !monitoring(r.From[0]) {
		t.Errorf("the proxies' admin port admits %+v, want monitoring alone", r.From)
	}
	if r := rule(px, "http"); len(r.From) != 0 {
		t.Errorf("the OpenAI port admits %+v, want anyone", r.From)
	}
	if off := render(t, "networkPolicy: {enabled: false}\n"); len(all[networkingv1.NetworkPolicy](t, off, "NetworkPolicy")) != 0 {
		t.Error("NetworkPolicies rendered while disabled")
	}
}
