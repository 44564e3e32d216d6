package controlplane_test

import (
	"net"
	"testing"
)

// TestKVTiersReachProxies: what a worker's registration says of its KV connector — its
// offloading tiers' bandwidths and its P2P side channel — reaches the proxies' workers, so
// that they price pulls and send disaggregated legs in the p2p form.
func TestKVTiersReachProxies(t *testing.T) {
	c := &cluster{t: t, workers: startWorkers(t, 2), dataDir: t.TempDir()}
	for i, w := range c.workers {
		s := specOf(i, w.URL(), w.EventsEndpoint(), w.ReplayEndpoint())
		if i == 0 {
			s.KVBytesPerToken, s.PeerBandwidth, s.P2PPort = 73728, 50e9, 5710
		}
		c.specs = append(c.specs, s)
	}
	c.startControlPlane("127.0.0.1:0")
	p := c.addProxy(c.cp.XDSAddr())
	waitWorkers(t, p, 2)
	for _, w := range p.Workers() {
		switch w.ID {
		case "w0":
			if w.P2PPort != 5710 || w.Engine.PeerBandwidth != 50e9 || w.Engine.KVBytesPerToken != 73728 {
				t.Errorf("w0 on the proxy: p2p port %d, peer bandwidth %g, %g bytes a token", w.P2PPort, w.Engine.PeerBandwidth, w.Engine.KVBytesPerToken)
			}
			if host, _, _ := net.SplitHostPort(w.Addr); w.P2PAddr() != net.JoinHostPort(host, "5710") {
				t.Errorf("w0's P2P address %q, want its host with port 5710", w.P2PAddr())
			}
		default:
			if w.P2PPort != 0 || w.P2PAddr() != w.Addr {
				t.Errorf("%s: p2p port %d, address %q", w.ID, w.P2PPort, w.P2PAddr())
			}
		}
	}
}
