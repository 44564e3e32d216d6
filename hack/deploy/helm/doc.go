// Package helm holds the kvrelay Helm chart (kvrelay/) and its tests: helm lint, the objects
// helm template renders for several sets of values, the flags they pass checked against the
// kvrelay binary's own, and, on a real kube-apiserver (internal/kubetest), an install, the
// control plane's RBAC exercised as its ServiceAccount, the control plane and a proxy run
// with the installed arguments, and an upgrade that keeps the generated API token.
//
// The tests run the helm that hack/helm.sh installs and skip without it.
package helm
