//go:build linux

package kubetest

import (
	"path/filepath"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Kubeconfig writes a kubeconfig file for the administrator (Config's user) into t.TempDir
// and returns its path: for tools that run beside the test and take --kubeconfig (helm,
// kubectl, a kvrelay binary).
func (e *Env) Kubeconfig(t testing.TB) string {
	t.Helper()
	return writeKubeconfig(t, e.config)
}

// KubeconfigFor is Kubeconfig for ConfigFor's user: a binary run with it acts as that user
// alone, e.g. as a ServiceAccount ("system:serviceaccount:<namespace>:<name>") that a
// chart's RBAC binds.
func (e *Env) KubeconfigFor(t testing.TB, user string, groups ...string) string {
	t.Helper()
	return writeKubeconfig(t, e.ConfigFor(t, user, groups...))
}

// writeKubeconfig writes cfg, whose credentials are inline (a token or certificate data, as
// Config and ConfigFor make them), as a kubeconfig of one context.
func writeKubeconfig(t testing.TB, cfg *rest.Config) string {
	t.Helper()
	const name = "kubetest"
	kc := clientcmdapi.NewConfig()
	kc.Clusters[name] = &clientcmdapi.Cluster{
		Server:                   cfg.Host,
		CertificateAuthorityData: cfg.CAData,
	}
	kc.AuthInfos[name] = &clientcmdapi.AuthInfo{
		Token:                 cfg.BearerToken,
		ClientCertificateData: cfg.CertData,
		ClientKeyData:         cfg.KeyData,
	}
	kc.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: name}
	kc.CurrentContext = name
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatalf("kubetest: writing kubeconfig: %v", err)
	}
	return path
}
