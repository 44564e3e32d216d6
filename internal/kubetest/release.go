package kubetest

// Release is the Kubernetes release whose kube-apiserver hack/kube-testenv/go.mod builds: the
// binaries' cache is keyed by it, and charts are rendered for it. A test checks that the two
// agree. (Not limited to Linux, as the API server's start is: chart tests render anywhere.)
const Release = "v1.37.2"
