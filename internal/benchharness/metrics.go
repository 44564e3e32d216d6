package benchharness

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrape reads a Prometheus text endpoint.
func scrape(url string) (map[string]*dto.MetricFamily, error) {
	fams, _, err := scrapeRaw(url)
	return fams, err
}

// scrapeRaw also returns the text, to keep beside the results.
func scrapeRaw(url string) (map[string]*dto.MetricFamily, []byte, error) {
	body, err := get(url)
	if err != nil {
		return nil, body, err
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(body))
	return fams, body, err
}

// saveScrape stores a metrics endpoint's text in path and returns its families (nil when it
// could not be read).
func saveScrape(url, path string) map[string]*dto.MetricFamily {
	if url == "" {
		return nil
	}
	fams, body, err := scrapeRaw(url)
	if body != nil {
		_ = os.WriteFile(path, body, 0o644)
	}
	if err != nil {
		return nil
	}
	return fams
}

// get returns what GET url answers; a status other than 200 is an error beside the body.
func get(url string) ([]byte, error) {
	resp, err := httpClient.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return body, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return body, nil
}

// saveGet writes what GET url answers (the proxy's learned latency model, say) to path; a
// failure leaves no file.
func saveGet(url, path string) {
	if b, err := get(url); err == nil {
		_ = os.WriteFile(path, b, 0o644)
	}
}

// labelsMatch reports whether m carries every label of want.
func labelsMatch(m *dto.Metric, want map[string]string) bool {
	for k, v := range want {
		found := false
		for _, l := range m.GetLabel() {
			if l.GetName() == k && l.GetValue() == v {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// gaugeSum sums a gauge's or counter's samples over all label sets.
func gaugeSum(fams map[string]*dto.MetricFamily, name string) (float64, bool) {
	return valueSum(fams, name, nil)
}

func valueSum(fams map[string]*dto.MetricFamily, name string, labels map[string]string) (float64, bool) {
	f, ok := fams[name]
	if !ok {
		return 0, false
	}
	var sum float64
	for _, m := range f.GetMetric() {
		if !labelsMatch(m, labels) {
			continue
		}
		switch {
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Untyped != nil:
			sum += m.GetUntyped().GetValue()
		}
	}
	return sum, true
}

// histQuantile is Prometheus's histogram_quantile over the samples of a histogram family
// whose labels match (summed over the rest): linear interpolation inside the bucket, the
// lowest bucket starting at 0. It returns the quantile in the metric's unit and the number
// of observations; NaN when there are none.
func histQuantile(fams map[string]*dto.MetricFamily, name string, labels map[string]string, q float64) (float64, uint64) {
	f, ok := fams[name]
	if !ok {
		return math.NaN(), 0
	}
	cum := map[float64]uint64{}
	var total uint64
	for _, m := range f.GetMetric() {
		h := m.GetHistogram()
		if h == nil || !labelsMatch(m, labels) {
			continue
		}
		total += h.GetSampleCount()
		for _, b := range h.GetBucket() {
			cum[b.GetUpperBound()] += b.GetCumulativeCount()
		}
	}
	if total == 0 {
		return math.NaN(), 0
	}
	bounds := make([]float64, 0, len(cum))
	for b := range cum {
		bounds = append(bounds, b)
	}
	sort.Float64s(bounds)
	rank := q * float64(total)
	lower, below := 0.0, uint64(0)
	for _, b := range bounds {
		c := cum[b]
		if float64(c) >= rank {
			if math.IsInf(b, 1) {
				return lower, total // beyond the last finite bucket: its bound, as Prometheus does
			}
			in := c - below
			if in == 0 {
				return b, total
			}
			return lower + (b-lower)*(rank-float64(below))/float64(in), total
		}
		lower, below = b, c
	}
	return lower, total // +Inf bucket missing and rank beyond the finite ones
}

// histSumCount is the sum and count of a histogram's observations over the matching samples.
func histSumCount(fams map[string]*dto.MetricFamily, name string, labels map[string]string) (float64, uint64) {
	f, ok := fams[name]
	if !ok {
		return 0, 0
	}
	var sum float64
	var n uint64
	for _, m := range f.GetMetric() {
		if h := m.GetHistogram(); h != nil && labelsMatch(m, labels) {
			sum += h.GetSampleSum()
			n += h.GetSampleCount()
		}
	}
	return sum, n
}

// findFamily returns the first name of names present in fams, or one ending in any of them.
func findFamily(fams map[string]*dto.MetricFamily, names ...string) string {
	for _, n := range names {
		if _, ok := fams[n]; ok {
			return n
		}
	}
	for _, n := range names {
		for k := range fams {
			if strings.HasSuffix(k, n) {
				return k
			}
		}
	}
	return ""
}

// WarmupShare is the share of a run's predicted requests, the first sent, that the
// prediction error leaves out: the latency model learns the engines from them.
const WarmupShare = 0.1

// predictionError puts the latency model's relative TTFT error into extra, over the
// successful requests the router predicted (the x-kvrelay-route header's ttft_ms) after the
// first WarmupShare of them: |predicted − actual| / actual, its p50 and p90, and how many
// requests it covers. Nothing when the router predicted nothing.
func predictionError(records []*bench.Record, extra map[string]float64) {
	var preds []*bench.Record
	for _, r := range records {
		if r.OK() && r.PredictedTTFT > 0 && r.TTFT > 0 {
			preds = append(preds, r)
		}
	}
	slices.SortStableFunc(preds, func(a, b *bench.Record) int { return cmp.Compare(a.Seq, b.Seq) })
	preds = preds[int(WarmupShare*float64(len(preds))):]
	if len(preds) == 0 {
		return
	}
	errs := make([]float64, len(preds))
	for i, r := range preds {
		errs[i] = math.Abs(float64(r.PredictedTTFT-r.TTFT)) / float64(r.TTFT)
	}
	extra["ttft_rel_error_p50"], extra["ttft_rel_error_p90"], extra["ttft_predictions"] = Quantile(errs, 0.5), Quantile(errs, 0.9), float64(len(errs))
}

// PredictionErrorOf fills extra with the prediction error of the requests a run saved
// (results.json in its directory), for results collected before the harness measured it.
func PredictionErrorOf(dir string, extra map[string]float64) {
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		return
	}
	var runs []struct {
		Records []*bench.Record `json:"records"`
	}
	if json.Unmarshal(b, &runs) != nil {
		return
	}
	var all []*bench.Record
	for _, r := range runs {
		all = append(all, r.Records...)
	}
	predictionError(all, extra)
}
