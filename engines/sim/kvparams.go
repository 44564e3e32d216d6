package sim

import (
	"bytes"
	"encoding/json"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
)

// kvTransferParams is vLLM NixlConnector's kv_transfer_params, as a proxy sends it on either
// leg of a disaggregated request:
//
//   - prefill leg: {"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}
//     (vLLM's toy proxy sends the remote fields as null);
//   - decode leg: the object the prefill worker answered with, {"do_remote_prefill": true,
//     "do_remote_decode": false, "remote_block_ids": [...], "remote_engine_id": "...",
//     "remote_request_id": "...", "remote_host": "...", "remote_port": n, "tp_size": 1}.
//
// A field that is null counts as absent. Unknown fields are ignored (other connectors add
// their own).
type kvTransferParams struct {
	DoRemoteDecode  bool
	DoRemotePrefill bool
	RemoteEngineID  string
	RemoteRequestID string
	RemoteBlockIDs  []int
	RemoteHost      string
	RemotePort      int
	TPSize          int
	// PeerFetch is the peer whose cached prefix of the prompt this worker pulls before
	// computing the rest, as its base URL (http://host:port), from vLLM's p2p offloading
	// parameter remote_kv_source {"kv_request_id", "remote_host", "remote_port"}. The
	// simulated engine's peer transport is its HTTP server (POST /kvrelay/kv/export), so
	// remote_port is that server's.
	PeerFetch string
	// MaxLoadTokens, when HasMaxLoad, caps the tokens loaded from offloading tiers beyond
	// the prefix cached in GPU memory (vLLM's max_load_tokens; 0 recomputes them all).
	MaxLoadTokens int
	HasMaxLoad    bool
}

// remoteKVSource is vLLM's kv_transfer_params.remote_kv_source.
type remoteKVSource struct {
	KVRequestID string `json:"kv_request_id"`
	RemoteHost  string `json:"remote_host"`
	RemotePort  int64  `json:"remote_port"`
}

// parseKVTransferParams checks and decodes kv_transfer_params. It returns nil, nil when the
// field is absent or null, and a 400 *apiError for anything a NixlConnector could not act
// on: a non-object, a known field of the wrong type, both directions at once, a decode leg
// without the remote fields it needs, block ids that are negative, not integers, or more
// than maxBlocks of them, an address that cannot be dialled.
func parseKVTransferParams(raw json.RawMessage, maxBlocks int) (*kvTransferParams, *apiError) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	bad := func(format string, args ...any) *apiError {
		e := badRequest("kv_transfer_params: "+format, args...)
		e.param = "kv_transfer_params"
		return e
	}
	if raw[0] != '{' {
		return nil, bad("must be an object")
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, bad("not a valid JSON object: %v", err)
	}
	p := &kvTransferParams{TPSize: 1}
	has := func(k string) (json.RawMessage, bool) {
		v, ok := fields[k]
		v = bytes.TrimSpace(v)
		if !ok || len(v) == 0 || string(v) == "null" {
			return nil, false
		}
		return v, true
	}
	for _, f := range []struct {
		name string
		dst  *bool
	}{{"do_remote_decode", &p.DoRemoteDecode}, {"do_remote_prefill", &p.DoRemotePrefill}} {
		if v, ok := has(f.name); ok {
			if err := json.Unmarshal(v, f.dst); err != nil {
				return nil, bad("%s must be a boolean", f.name)
			}
		}
	}
	for _, f := range []struct {
		name string
		dst  *string
	}{{"remote_engine_id", &p.RemoteEngineID}, {"remote_request_id", &p.RemoteRequestID}, {"remote_host", &p.RemoteHost}} {
		if v, ok := has(f.name); ok {
			if v[0] != '"' || json.Unmarshal(v, f.dst) != nil {
				return nil, bad("%s must be a string", f.name)
			}
			if len(*f.dst) > 1024 {
				return nil, bad("%s is longer than 1024 bytes", f.name)
			}
		}
	}
	for _, f := range []struct {
		name     string
		dst      *int
		min, max int64
	}{{"remote_port", &p.RemotePort, 1, 65535}, {"tp_size", &p.TPSize, 1, 1 << 16}} {
		if v, ok := has(f.name); ok {
			n, err := strconv.ParseInt(string(v), 10, 64)
			if err != nil || n < f.min || n > f.max {
				return nil, bad("%s must be an integer from %d to %d", f.name, f.min, f.max)
			}
			*f.dst = int(n)
		}
	}
	if v, ok := has("remote_block_ids"); ok {
		ids, err := parseBlockIDs(v, maxBlocks)
		if err != nil {
			return nil, bad("%s", err.message)
		}
		p.RemoteBlockIDs = ids
	}
	if v, ok := has("remote_kv_source"); ok {
		var src remoteKVSource
		if v[0] != '{' || json.Unmarshal(v, &src) != nil {
			return nil, bad("remote_kv_source must be an object {kv_request_id, remote_host, remote_port}")
		}
		if src.RemoteHost == "" || len(src.RemoteHost) > 1024 || (strings.ContainsAny(src.RemoteHost, " \t\r\n/@?#[]") && net.ParseIP(strings.Trim(src.RemoteHost, "[]")) == nil) {
			return nil, bad("remote_kv_source.remote_host %q is not a host name or IP address", src.RemoteHost)
		}
		if src.RemotePort < 1 || src.RemotePort > 65535 {
			return nil, bad("remote_kv_source.remote_port must be an integer from 1 to 65535")
		}
		if len(src.KVRequestID) > 1024 {
			return nil, bad("remote_kv_source.kv_request_id is longer than 1024 bytes")
		}
		if p.DoRemoteDecode || p.DoRemotePrefill {
			return nil, bad("remote_kv_source cannot go with do_remote_decode or do_remote_prefill")
		}
		p.PeerFetch = (&url.URL{Scheme: "http", Host: net.JoinHostPort(strings.Trim(src.RemoteHost, "[]"), strconv.FormatInt(src.RemotePort, 10))}).String()
	}
	if v, ok := has("max_load_tokens"); ok {
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil || n < 0 || n > math.MaxInt32 {
			return nil, bad("max_load_tokens must be an integer from 0 to 2^31-1")
		}
		p.MaxLoadTokens, p.HasMaxLoad = int(n), true
	}
	if p.DoRemoteDecode && p.DoRemotePrefill {
		return nil, bad("do_remote_decode and do_remote_prefill cannot both be true")
	}
	if p.DoRemotePrefill && len(p.RemoteBlockIDs) > 0 {
		var missing []string
		for _, f := range []struct {
			name string
			ok   bool
		}{{"remote_engine_id", p.RemoteEngineID != ""}, {"remote_request_id", p.RemoteRequestID != ""}, {"remote_host", p.RemoteHost != ""}, {"remote_port", p.RemotePort != 0}} {
			if !f.ok {
				missing = append(missing, f.name)
			}
		}
		if len(missing) > 0 {
			return nil, bad("do_remote_prefill needs %s", strings.Join(missing, ", "))
		}
		if strings.ContainsAny(p.RemoteHost, " \t\r\n/@?#[]") && net.ParseIP(strings.Trim(p.RemoteHost, "[]")) == nil {
			return nil, bad("remote_host %q is not a host name or IP address", p.RemoteHost)
		}
		if strings.ContainsAny(p.RemoteRequestID, "\x00") {
			return nil, bad("remote_request_id must not contain NUL")
		}
	}
	return p, nil
}

// parseBlockIDs decodes a JSON array of block ids without decoding more than maxBlocks of
// them.
func parseBlockIDs(v json.RawMessage, maxBlocks int) ([]int, *apiError) {
	if v[0] != '[' {
		return nil, badRequest("remote_block_ids must be an array of integers")
	}
	if n := bytes.Count(v, []byte{','}) + 1; n > maxBlocks+1 {
		// Commas can also sit inside strings, so this bound is loose; the exact check is below.
		return nil, badRequest("remote_block_ids lists more than %d blocks", maxBlocks)
	}
	var nums []json.Number
	dec := json.NewDecoder(bytes.NewReader(v))
	dec.UseNumber()
	if err := dec.Decode(&nums); err != nil {
		return nil, badRequest("remote_block_ids must be an array of integers")
	}
	if len(nums) > maxBlocks {
		return nil, badRequest("remote_block_ids lists %d blocks, more than the %d a request can have", len(nums), maxBlocks)
	}
	ids := make([]int, len(nums))
	for i, n := range nums {
		id, err := strconv.ParseInt(string(n), 10, 64)
		if err != nil || id < 0 || id > math.MaxInt32 {
			return nil, badRequest("remote_block_ids[%d] = %s is not a block id (an integer from 0 to 2^31-1)", i, n)
		}
		ids[i] = int(id)
	}
	return ids, nil
}
