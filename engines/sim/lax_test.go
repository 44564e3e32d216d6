package sim

import (
	"encoding/json"
	"testing"
)

func TestLaxFields(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{
		{`5`, 5, true}, {`5.0`, 5, true}, {`1e3`, 1000, true}, {`"5"`, 5, true}, {`" 7 "`, 7, true},
		{`"+8"`, 8, true}, {`"1_000"`, 1000, true}, {`true`, 1, true}, {`false`, 0, true},
		{`5.5`, 0, false}, {`"five"`, 0, false}, {`"1__0"`, 0, false}, {`"_1"`, 0, false}, {`[1]`, 0, false},
		{`{}`, 0, false}, {`"\u0035"`, 0, false}, {`1e400`, 0, false},
	} {
		var v struct {
			N laxInt `json:"n"`
		}
		err := json.Unmarshal([]byte(`{"n":`+tc.in+`}`), &v)
		if (err == nil) != tc.ok || tc.ok && int(v.N) != tc.want {
			t.Errorf("int %s: %d, %v; want %d, ok %v", tc.in, v.N, err, tc.want, tc.ok)
		}
	}
	for _, tc := range []struct {
		in       string
		want, ok bool
	}{
		{`true`, true, true}, {`false`, false, true}, {`1`, true, true}, {`0.0`, false, true},
		{`"yes"`, true, true}, {`"OFF"`, false, true}, {`"t"`, true, true}, {`"N"`, false, true},
		{`"1"`, true, true}, {`2`, false, false}, {`"maybe"`, false, false}, {`"1.0"`, false, false}, {`[]`, false, false},
	} {
		var v struct {
			B laxBool `json:"b"`
		}
		err := json.Unmarshal([]byte(`{"b":`+tc.in+`}`), &v)
		if (err == nil) != tc.ok || tc.ok && bool(v.B) != tc.want {
			t.Errorf("bool %s: %v, %v; want %v, ok %v", tc.in, v.B, err, tc.want, tc.ok)
		}
	}
}
