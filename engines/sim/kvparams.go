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
// or as vLLM's OffloadingConnector takes them from a proxy when its p2p tier carries a
// disaggregated request (its tests' p2p_connector_proxy.py):
//
//   - prefill leg: {"remote_decoder": {"kv_request_id": "..."}}: compute the prompt and hold
//     its blocks for the decoder that names kv_request_id (it may also carry
//     remote_kv_source, to pull a prefix from a peer first);
//   - decode leg: {"remote_prefiller": {"kv_request_id", "remote_host", "remote_port"}}: pull
//     the prompt's blocks from the prefiller at that address and decode.
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
	// KVRequestID names the request across the two legs of vLLM's p2p form: the prefill
	// leg's hold (remote_decoder) and the decode leg's pull (remote_prefiller), so that the
	// prefiller frees the leg's blocks once its decoder has taken them.
	KVRequestID string
	// FromPrefiller: PeerFetch is the prefill worker of this decode leg (remote_prefiller).
	FromPrefiller bool
	// ForDecoder: a prefill leg in the p2p form (remote_decoder), whose answer carries no
	// kv_transfer_params (its decoder is told where to pull by the proxy).
	ForDecoder bool
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
	nixl := p.DoRemoteDecode || p.DoRemotePrefill
	// source checks an object naming a peer ({kv_request_id, remote_host, remote_port}) and
	// returns its base URL.
	source := func(name string, v json.RawMessage, needID bool) (string, string, *apiError) {
		var src remoteKVSource
		if v[0] != '{' || json.Unmarshal(v, &src) != nil {
			return "", "", bad("%s must be an object {kv_request_id, remote_host, remote_port}", name)
		}
		if src.RemoteHost == "" || len(src.RemoteHost) > 1024 || (strings.ContainsAny(src.RemoteHost, " \t\r\n/@?#[]:%") && net.ParseIP(strings.Trim(src.RemoteHost, "[]")) == nil) {
			return "", "", bad("%s.remote_host %q is not a host name or IP address", name, src.RemoteHost)
		}
		if src.RemotePort < 1 || src.RemotePort > 65535 {
			return "", "", bad("%s.remote_port must be an integer from 1 to 65535", name)
		}
		if len(src.KVRequestID) > 1024 || strings.ContainsRune(src.KVRequestID, 0) {
			return "", "", bad("%s.kv_request_id is longer than 1024 bytes or holds NUL", name)
		}
		if needID && src.KVRequestID == "" {
			return "", "", bad("%s needs kv_request_id", name)
		}
		return (&url.URL{Scheme: "http", Host: net.JoinHostPort(strings.Trim(src.RemoteHost, "[]"), strconv.FormatInt(src.RemotePort, 10))}).String(), src.KVRequestID, nil
	}
	if v, ok := has("remote_decoder"); ok {
		var dst struct {
			KVRequestID *string `json:"kv_request_id"`
		}
		if v[0] != '{' || json.Unmarshal(v, &dst) != nil {
			return nil, bad("remote_decoder must be an object {kv_request_id}")
		}
		if dst.KVRequestID != nil && (len(*dst.KVRequestID) > 1024 || strings.ContainsRune(*dst.KVRequestID, 0)) {
			return nil, bad("remote_decoder.kv_request_id is longer than 1024 bytes or holds NUL")
		}
		if nixl {
			return nil, bad("remote_decoder cannot go with do_remote_decode or do_remote_prefill")
		}
		p.DoRemoteDecode, p.ForDecoder = true, true
		if dst.KVRequestID != nil {
			p.KVRequestID = *dst.KVRequestID
		}
	}
	if v, ok := has("remote_prefiller"); ok {
		if nixl || p.DoRemoteDecode {
			return nil, bad("remote_prefiller cannot go with do_remote_decode, do_remote_prefill or remote_decoder")
		}
		if _, ok := has("remote_kv_source"); ok {
			return nil, bad("remote_prefiller and remote_kv_source name two sources")
		}
		peer, id, aerr := source("remote_prefiller", v, true)
		if aerr != nil {
			return nil, aerr
		}
		p.PeerFetch, p.KVRequestID, p.FromPrefiller = peer, id, true
	}
	if v, ok := has("remote_kv_source"); ok {
		if nixl {
			return nil, bad("remote_kv_source cannot go with do_remote_decode or do_remote_prefill")
		}
		peer, _, aerr := source("remote_kv_source", v, false)
		if aerr != nil {
			return nil, aerr
		}
		p.PeerFetch = peer
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
		if strings.ContainsAny(p.RemoteHost, " \t\r\n/@?#[]:%") && net.ParseIP(strings.Trim(p.RemoteHost, "[]")) == nil {
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
