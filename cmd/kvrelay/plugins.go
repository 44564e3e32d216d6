package main

import (
	"sync"

	"github.com/kvrelay/kvrelay/dataplane/route"
)

// routingPlugins is the one registry of routing plugins this program has: the proxies
// build pushed policy profiles with it and the control plane validates profiles against it
// before pushing them. A new scorer, filter or picker is registered here, next to the
// built-ins.
var routingPlugins = sync.OnceValue(func() *route.Registry {
	r := route.NewRegistry()
	route.RegisterBuiltins(r)
	return r
})
