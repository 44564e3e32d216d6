package engines

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// ParseBandwidth reads a bandwidth in bytes per second: a number with a decimal unit
// ("800MB/s", "50GB/s", "1.6TB/s", "/s" optional) or a bare number of GB/s ("50").
func ParseBandwidth(s string) (float64, error) {
	t := strings.TrimSuffix(strings.TrimSpace(s), "/s")
	mult := 1e9
	for _, u := range []struct {
		suffix string
		mult   float64
	}{{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"kB", 1e3}, {"B", 1}} {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || !(v > 0) || math.IsInf(v, 0) {
		return 0, fmt.Errorf("bandwidth %q is not a positive number of GB/s or a size per second like 800MB/s", s)
	}
	return v * mult, nil
}

// FormatBandwidth writes bytes per second in the form ParseBandwidth reads back exactly
// ("25GB/s"; in bytes when a larger unit would not read back to the same value).
func FormatBandwidth(v float64) string {
	for _, u := range []struct {
		suffix string
		mult   float64
	}{{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}} {
		if v >= u.mult {
			if s := strconv.FormatFloat(v/u.mult, 'g', -1, 64) + u.suffix + "/s"; roundTrips(s, v) {
				return s
			}
		}
	}
	return strconv.FormatFloat(v, 'g', -1, 64) + "B/s"
}

func roundTrips(s string, v float64) bool {
	got, err := ParseBandwidth(s)
	return err == nil && got == v
}
