package sim

import (
	"bytes"
	"errors"
	"math"
	"strconv"
	"strings"
)

// vLLM validates requests with pydantic in its default lax mode, and the simulated engine
// accepts what that accepts: an integer field takes 5, 5.0, 1e3, "5", " 5 ", "1_000" and
// true/false; a boolean field takes true/false, 0/1 and the strings "true", "yes", "on",
// "y", "t", "1" (and their opposites) in any case. null leaves the field unset.
type (
	laxInt  int
	laxBool bool
)

var (
	errNotInt  = errors.New("must be a valid integer")
	errNotBool = errors.New("must be a valid boolean")
)

func (v *laxInt) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case string(b) == "null":
		return nil
	case string(b) == "true":
		*v = 1
		return nil
	case string(b) == "false":
		*v = 0
		return nil
	case len(b) > 0 && b[0] == '"':
		s, err := strconv.Unquote(string(b))
		if err != nil || strings.ContainsRune(string(b), '\\') {
			return errNotInt
		}
		s = strings.TrimSpace(s)
		if strings.Contains(s, "_") {
			for i := 0; i < len(s); i++ {
				if s[i] == '_' && (i == 0 || i == len(s)-1 || !isDigit(s[i-1]) || !isDigit(s[i+1])) {
					return errNotInt
				}
			}
			s = strings.ReplaceAll(s, "_", "")
		}
		return v.parse(strings.TrimPrefix(s, "+"))
	}
	return v.parse(string(b))
}

func (v *laxInt) parse(s string) error {
	if i, err := strconv.ParseInt(s, 10, 64); err == nil {
		if i != int64(int(i)) {
			return errNotInt
		}
		*v = laxInt(i)
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.IsInf(f, 0) || f < math.MinInt64 || f >= math.MaxInt64 {
		return errNotInt
	}
	*v = laxInt(f)
	return nil
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func (v *laxBool) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	s := string(b)
	switch {
	case s == "null":
		return nil
	case len(b) > 0 && b[0] == '"':
		u, err := strconv.Unquote(s)
		if err != nil || strings.ContainsRune(s, '\\') {
			return errNotBool
		}
		s = strings.ToLower(u)
	}
	switch s {
	case "true", "1", "t", "y", "on", "yes":
		*v = true
	case "false", "0", "f", "n", "no", "off":
		*v = false
	default:
		if f, err := strconv.ParseFloat(s, 64); err == nil && (f == 0 || f == 1) && b[0] != '"' {
			*v = f == 1
			return nil
		}
		return errNotBool
	}
	return nil
}
