package proxy

import (
	"bytes"
	"strconv"
	"testing"
	"time"
)

// FuzzResponseID: the id scan never panics, and an id it returns is a plain string that
// appears in the input as the value of an "id" member.
func FuzzResponseID(f *testing.F) {
	for _, s := range []string{
		`{"id":"resp_1","object":"response"}`,
		"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_2\"}}\n\n",
		`{"id" : "x"`, `{"id":`, `{"id":"a\"b"}`, `"id""id":"z"`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		id, ok := responseID(b)
		if !ok {
			return
		}
		if id == "" || len(id) > 256 || bytes.ContainsAny([]byte(id), "\"\\") {
			t.Fatalf("id %q", id)
		}
		if !bytes.Contains(b, []byte(`"`+id+`"`)) || !bytes.Contains(b, []byte(`"id"`)) {
			t.Fatalf("id %q not in %q", id, b)
		}
	})
}

func TestRespTableBoundsAndExpires(t *testing.T) {
	tab := newRespTable(3, time.Minute)
	for i := range 5 {
		tab.put("r"+strconv.Itoa(i), "w"+strconv.Itoa(i), 0)
	}
	for i, want := range []bool{false, false, true, true, true} {
		if _, ok := tab.get("r"+strconv.Itoa(i), 0); ok != want {
			t.Errorf("r%d kept %v, want %v (the oldest go first)", i, ok, want)
		}
	}
	if w, ok := tab.get("r4", int64(30*time.Second)); !ok || w != "w4" {
		t.Errorf("r4 within its ttl: %q %v", w, ok)
	}
	if _, ok := tab.get("r4", int64(2*time.Minute)); ok {
		t.Error("r4 past its ttl is still known")
	}
	if len(tab.m) > 3 {
		t.Errorf("table holds %d entries over its bound 3", len(tab.m))
	}
}
