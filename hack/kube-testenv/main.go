// Command kube-apiserver is the upstream kube-apiserver, built from the Go module proxy for
// the tests that need a real API server (internal/kubetest). It is the body of
// k8s.io/kubernetes/cmd/kube-apiserver/apiserver.go: that file is package main, so it cannot
// be imported, and this module's go.mod pins the release and its staging modules.
// hack/kube-testenv.sh builds it; nothing in the main module imports it.
package main

import (
	"os"
	_ "time/tzdata" // CronJob time zones, as upstream

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // --logging-format=json
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
