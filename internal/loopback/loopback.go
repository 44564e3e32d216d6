// Package loopback guards HTTP listeners bound to loopback against DNS rebinding: a web page
// whose DNS name is rebound to 127.0.0.1 reaches such a listener from the user's browser,
// and its requests carry that name as Host.
package loopback

import (
	"net"
	"net/http"
	"strings"
)

// HostOnly serves h only to requests whose Host is localhost or a loopback address; others
// get 421 with a JSON error saying so (what names the listener in it), and reject, when not
// nil, hears of each.
func HostOnly(h http.Handler, what string, reject func(*http.Request)) http.Handler {
	body := []byte(`{"error":{"code":"PERMISSION_DENIED","message":"` + what + ` listens on loopback and answers only Host: localhost or a loopback address"}}` + "\n")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !LocalHost(r.Host) {
			if reject != nil {
				reject(r)
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusMisdirectedRequest)
			_, _ = w.Write(body)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// LocalHost reports whether host (a Host header: a name or an address, with or without a
// port) is localhost or a loopback address.
func LocalHost(host string) bool {
	if hp, _, err := net.SplitHostPort(host); err == nil {
		host = hp
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return strings.EqualFold(host, "localhost") || ip != nil && ip.IsLoopback()
}

// Addr reports whether a is a loopback TCP address.
func Addr(a net.Addr) bool {
	tcp, ok := a.(*net.TCPAddr)
	return ok && tcp.IP.IsLoopback()
}

// FreeAddr returns a loopback address (127.0.0.1:port) whose port nothing listened on a
// moment ago: for a process that must be told its address before it binds it (a replica's
// peers, a publisher that connects out).
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
