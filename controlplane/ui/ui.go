// Package ui is the operator console: one page (assets/, embedded in the binary: no CDN, no
// build step) that the control plane serves under /ui/. It reads the control plane's JSON
// endpoints, the same that kvrelay ctl reads (/v1/fleet, /v1/events, /v1/decisions,
// /v1/prefixes, /v1/planner/decisions, /v1/rollout), follows the fleet live over
// Server-Sent Events, and sends rollout actions (POST /v1/rollout/{pause,resume,promote,
// abort}) with the operator's token. Reads follow the API's rule: open on loopback, a token
// elsewhere (the page asks for it and keeps it for the tab's session).
package ui

import (
	"embed"
	"io/fs"
	"net/http"
)

//go:embed assets
var assets embed.FS

// Handler serves the console's files under prefix (for example "/ui/"): the page at the
// prefix itself, its script and style beside it.
func Handler(prefix string) http.Handler {
	sub, _ := fs.Sub(assets, "assets")
	files := http.StripPrefix(prefix, http.FileServer(http.FS(sub)))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		// The page runs only its own script and style and talks only to this origin.
		w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Cache-Control", "no-cache")
		files.ServeHTTP(w, r)
	})
}
