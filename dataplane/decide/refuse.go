package decide

import (
	"encoding/json"
	"strconv"
)

// Refusal is a request the core will not route, or not now: the status, the OpenAI error
// (message, param, code) and the Retry-After in seconds (0: none) its carrier answers it
// with.
type Refusal struct {
	Status     int
	Message    string
	Param      string
	Code       string
	RetryAfter int
}

func (e *Refusal) Error() string {
	return "refused (" + strconv.Itoa(e.Status) + "): " + e.Message
}

// Body is the error as an OpenAI client expects it: {"error": {"message", "type", "param",
// "code"}}.
func (e *Refusal) Body() []byte {
	return AppendErrorJSON(nil, e.Status, e.Message, e.Param, e.Code)
}

func refusal(status int, msg, param, code string) *Refusal {
	return &Refusal{Status: status, Message: msg, Param: param, Code: code}
}

// maxRetryAfter bounds the Retry-After the core asks for, in seconds.
const maxRetryAfter = 60

// clampRetryAfter is secs within [1, maxRetryAfter].
func clampRetryAfter(secs int) int { return min(max(secs, 1), maxRetryAfter) }

// AppendErrorJSON appends {"error":{"message","type","param","code"}}. Errors are off the
// fast path, so encoding/json does the escaping.
func AppendErrorJSON(dst []byte, status int, msg, param, code string) []byte {
	type body struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	}
	e := body{Message: msg, Type: errorType(status)}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	b, _ := json.Marshal(struct {
		Error body `json:"error"`
	}{e})
	return append(dst, b...)
}

// errorType is the OpenAI error type of a status.
func errorType(status int) string {
	switch {
	case status == 401:
		return "authentication_error"
	case status == 404:
		return "not_found_error"
	case status == 429:
		return "rate_limit_error"
	case status >= 500:
		return "server_error"
	}
	return "invalid_request_error"
}
