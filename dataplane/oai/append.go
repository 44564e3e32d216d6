package oai

import "strconv"

// AppendWithField appends body to dst with the top-level member "name": value added just
// before the object's closing brace, leaving every other byte as it was. Python's json.loads
// keeps the last of duplicate keys, so the added member overrides one the body already has
// (the proxy uses it to forward vLLM's "priority" translated from an agent hint). body must
// be a JSON object that Parse accepted; anything else is appended unchanged. It allocates
// only when dst lacks capacity.
func AppendWithField(dst, body []byte, name string, value int) []byte {
	var num [20]byte
	return AppendWithRawField(dst, body, name, strconv.AppendInt(num[:0], int64(value), 10))
}

// AppendWithRawField is AppendWithField with a raw JSON value (an object such as
// kv_transfer_params, a string already quoted, …), which must itself be valid JSON.
func AppendWithRawField(dst, body []byte, name string, raw []byte) []byte {
	end := len(body) - 1
	for end >= 0 && isWS(body[end]) {
		end--
	}
	if end < 0 || body[end] != '}' {
		return append(dst, body...)
	}
	prev := end - 1
	for prev >= 0 && isWS(body[prev]) {
		prev--
	}
	if prev < 0 {
		return append(dst, body...)
	}
	dst = append(dst, body[:end]...)
	if body[prev] != '{' {
		dst = append(dst, ',')
	}
	dst = appendJSONString(dst, name)
	dst = append(dst, ':')
	dst = append(dst, raw...)
	return append(dst, body[end:]...)
}
