package controlplane_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
)

// TestAPIReadTimeout: a client that sends a request's head and then trickles nothing of its
// body loses its connection at the read timeout, while the console's event stream goes on
// past the server's write timeout (each event has its own).
func TestAPIReadTimeout(t *testing.T) {
	cp, err := controlplane.New(controlplane.Options{XDSListen: "127.0.0.1:0", APIListen: "127.0.0.1:0", DataDir: t.TempDir(),
		APIToken: "secret", APIReadTimeout: 300 * time.Millisecond, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Close() })
	c, err := net.Dial("tcp", cp.APIAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "PUT /v1/policy HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer secret\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pol")
	start := time.Now()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, _ = io.ReadAll(c) // until the server closes
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("a stalled body held its connection %v", took)
	}

	req, _ := http.NewRequest("GET", "http://"+cp.APIAddr()+"/v1/events", nil)
	req.Host = "localhost"
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	events := 0
	deadline := time.Now().Add(1500 * time.Millisecond) // past twice the read timeout
	for time.Now().Before(deadline) {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("the event stream ended after %d events: %v", events, err)
		}
		if strings.HasPrefix(line, "event: fleet") {
			events++
		}
	}
	if events < 2 {
		t.Fatalf("%d events in 1.5 s", events)
	}
}

// TestXDSPerPeerCapsAreSettable: XDSMaxConnsPerPeer reaches the xDS server: past it, a
// source address's next connection is closed at once.
func TestXDSPerPeerCapsAreSettable(t *testing.T) {
	cp, err := controlplane.New(controlplane.Options{XDSListen: "127.0.0.1:0", DataDir: t.TempDir(), XDSMaxConnsPerPeer: 1, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Close() })
	first, err := net.Dial("tcp", cp.XDSAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	second, err := net.Dial("tcp", cp.XDSAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	_ = second.SetReadDeadline(time.Now().Add(5 * time.Second))
	var b [64]byte
	for {
		if _, err := second.Read(b[:]); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatal("a second connection from one address was kept past XDSMaxConnsPerPeer 1")
			}
			break
		}
	}
}
