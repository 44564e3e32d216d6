package proxy_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// responsesEngine is an engine with a Responses API store of its own: a response is
// retrievable, and usable as previous_response_id, only on the engine that created it.
func responsesEngine(t *testing.T, name string) string {
	var mu sync.Mutex
	stored := map[string]bool{}
	n := 0
	answer := func(conn net.Conn, status int, body string) {
		fmt.Fprintf(conn, "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", status, len(body), body)
	}
	return fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, req *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if id, ok := strings.CutPrefix(req.URL.Path, "/v1/responses/"); ok {
			if !stored[id] {
				answer(conn, 404, `{"error":{"message":"Response with id '`+id+`' not found.","type":"invalid_request_error"}}`)
				return
			}
			answer(conn, 200, `{"id":"`+id+`","object":"response","status":"completed","served_by":"`+name+`"}`)
			return
		}
		var in struct {
			Previous string `json:"previous_response_id"`
			Stream   bool   `json:"stream"`
		}
		body, _ := io.ReadAll(req.Body)
		_ = json.Unmarshal(body, &in)
		if in.Previous != "" && !stored[in.Previous] {
			answer(conn, 404, `{"error":{"message":"Response with id '`+in.Previous+`' not found.","type":"invalid_request_error"}}`)
			return
		}
		n++
		id := fmt.Sprintf("resp_%s_%d", name, n)
		stored[id] = true
		if in.Stream {
			io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			for _, ev := range []string{
				`event: response.created` + "\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"` + id + `","object":"response","status":"in_progress"}}` + "\n\n",
				`event: response.output_text.delta` + "\n" + `data: {"type":"response.output_text.delta","sequence_number":1,"item_id":"msg_1","delta":"hi"}` + "\n\n",
				`event: response.completed` + "\n" + `data: {"type":"response.completed","sequence_number":2,"response":{"id":"` + id + `","status":"completed"}}` + "\n\n",
			} {
				fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev)
			}
			io.WriteString(conn, "0\r\n\r\n")
			return
		}
		answer(conn, 200, `{"id":"`+id+`","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],"served_by":"`+name+`"}`)
	})
}

// A follow-up naming a stored response (previous_response_id) and GET /v1/responses/{id}
// reach the engine that stored it, whatever the policy would pick; an unknown id is 404.
func TestResponsesFollowTheirStoredResponse(t *testing.T) {
	p := startProxy(t, []string{responsesEngine(t, "e0"), responsesEngine(t, "e1")}, func(cfg *proxy.Config) { cfg.Policy = "round-robin" })
	base := "http://" + p.Addr()
	for _, stream := range []bool{false, true} {
		resp, body := post(t, base+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"hello","stream":%v}`, model, stream))
		if resp.StatusCode != 200 {
			t.Fatalf("create (stream %v): %d %s", stream, resp.StatusCode, body)
		}
		id := strings.SplitN(strings.SplitN(string(body), `"id":"`, 2)[1], `"`, 2)[0]
		for i := range 4 {
			r, b := post(t, base+"/v1/responses", fmt.Sprintf(`{"model":%q,"input":"and then %d","previous_response_id":%q}`, model, i, id))
			if r.StatusCode != 200 {
				t.Fatalf("follow-up %d of %s (stream %v): %d %s", i, id, stream, r.StatusCode, b)
			}
		}
		code, got := get(t, base+"/v1/responses/"+id)
		if code != 200 || !strings.Contains(got, `"id":"`+id+`"`) {
			t.Fatalf("GET /v1/responses/%s: %d %s", id, code, got)
		}
	}
	if code, got := get(t, base+"/v1/responses/resp_nobody"); code != 404 || !strings.Contains(got, `"error"`) {
		t.Fatalf("GET of an unknown response: %d %s", code, got)
	}
	_, m := get(t, base+"/metrics")
	if v := metricValue(t, m, `kvrelay_proxy_response_affinity_total{outcome="pinned"}`); v != 10 {
		t.Errorf("pinned %v, want 10 (8 follow-ups, 2 GETs)", v)
	}
}
