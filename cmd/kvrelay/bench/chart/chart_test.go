package chart

import (
	"bytes"
	"encoding/xml"
	"errors"
	"image"
	"image/color"
	"image/png"
	"io"
	"math"
	"slices"
	"strings"
	"testing"
)

func lineChart() *Chart {
	var a, b []Point
	for i := range 50 {
		x := float64(i) * 0.013
		a = append(a, Point{x, float64(i+1) / 50})
		b = append(b, Point{x * 1.7, math.Sqrt(float64(i+1) / 50)})
	}
	return &Chart{
		Title: "Time to first token", XLabel: "TTFT (s)", YLabel: "fraction of samples",
		FixY: true, YMin: 0, YMax: 1,
		Lines: []Line{
			{Label: "kv", Points: a, Color: Color(0)},
			{Label: "round-robin", Points: b, Color: Color(1), Dash: Dashes(1)},
		},
	}
}

func barChart() *Chart {
	return &Chart{
		Title: "Prefix cache hit rate", YLabel: "cached prompt tokens / prompt tokens",
		FixY: true, YMin: 0, YMax: 1,
		Categories: []string{"latency", "kv", "round-robin"},
		Bars: []Bars{
			{Label: "measured", Values: []float64{0.9, 0.85, 0.4}, Color: Color(0)},
			{Label: "ideal (unbounded cache)", Values: []float64{0.95, 0.95, 0.95}, Color: Gray},
		},
		LegendTop: true,
	}
}

// svgDoc is what the tests read back from an SVG.
type svgDoc struct {
	Width     int `xml:"width,attr"`
	Height    int `xml:"height,attr"`
	Polylines []struct {
		Stroke string `xml:"stroke,attr"`
		Dash   string `xml:"stroke-dasharray,attr"`
		Points string `xml:"points,attr"`
	} `xml:"polyline"`
	Rects []struct {
		Fill   string  `xml:"fill,attr"`
		Height float64 `xml:"height,attr"`
	} `xml:"rect"`
	Texts []string `xml:"text"`
}

func readSVG(t *testing.T, c *Chart, w, h int) svgDoc {
	t.Helper()
	var buf bytes.Buffer
	if err := c.SVG(&buf, w, h); err != nil {
		t.Fatal(err)
	}
	var doc svgDoc
	if err := xml.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatalf("svg does not parse: %v\n%s", err, buf.String())
	}
	return doc
}

func readPNG(t *testing.T, c *Chart, w, h int) image.Image {
	t.Helper()
	var buf bytes.Buffer
	if err := c.PNG(&buf, w, h); err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if got := img.Bounds().Size(); got != (image.Point{w, h}) {
		t.Fatalf("png size %v, want %dx%d", got, w, h)
	}
	return img
}

// count returns how many pixels of img are within 40 of c in every channel.
func count(img image.Image, c color.RGBA) int {
	n := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			if near(r>>8, c.R) && near(g>>8, c.G) && near(bl>>8, c.B) {
				n++
			}
		}
	}
	return n
}

func near(v uint32, w uint8) bool { return max(v, uint32(w))-min(v, uint32(w)) <= 40 }

func TestSVG(t *testing.T) {
	cases := []struct {
		name       string
		chart      *Chart
		texts      []string // must all appear
		colors     []string // strokes or fills that must appear
		dashed     int      // polylines with a dash pattern
		minPolyPts int      // the longest polyline has at least this many points
	}{
		{"lines", lineChart(), []string{"Time to first token", "TTFT (s)", "fraction of samples", "kv", "round-robin", "0.0", "1.0"},
			[]string{"#f15a60", "#7ac36a"}, 2, 50}, // the line and its legend swatch
		{"bars", barChart(), []string{"Prefix cache hit rate", "latency", "kv", "round-robin", "measured", "ideal (unbounded cache)"},
			[]string{"#f15a60", "#aaaaaa"}, 0, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			doc := readSVG(t, tc.chart, 800, 500)
			if doc.Width != 800 || doc.Height != 500 {
				t.Errorf("size %dx%d", doc.Width, doc.Height)
			}
			for _, s := range tc.texts {
				if !slices.Contains(doc.Texts, s) {
					t.Errorf("no text %q in %q", s, doc.Texts)
				}
			}
			var colors []string
			dashed, longest := 0, 0
			for _, p := range doc.Polylines {
				colors = append(colors, p.Stroke)
				if p.Dash != "" {
					dashed++
				}
				longest = max(longest, len(strings.Fields(p.Points)))
			}
			for _, r := range doc.Rects {
				colors = append(colors, r.Fill)
			}
			for _, c := range tc.colors {
				if !slices.Contains(colors, c) {
					t.Errorf("no element coloured %s", c)
				}
			}
			if dashed != tc.dashed {
				t.Errorf("%d dashed polylines, want %d", dashed, tc.dashed)
			}
			if longest < tc.minPolyPts {
				t.Errorf("longest polyline %d points, want ≥ %d", longest, tc.minPolyPts)
			}
		})
	}
}

func TestSVGEscapesText(t *testing.T) {
	c := lineChart()
	c.Title = `a<b & "c"`
	doc := readSVG(t, c, 400, 300)
	if !slices.Contains(doc.Texts, `a<b & "c"`) {
		t.Errorf("title lost in %q", doc.Texts)
	}
}

func TestPNG(t *testing.T) {
	cases := []struct {
		name  string
		chart *Chart
		// colours that must cover at least min pixels each
		colors []color.RGBA
		min    int
	}{
		{"lines", lineChart(), []color.RGBA{Color(0), Color(1), black}, 200},
		{"bars", barChart(), []color.RGBA{Color(0), Gray, black}, 500},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			img := readPNG(t, tc.chart, 800, 500)
			for _, c := range tc.colors {
				if n := count(img, c); n < tc.min {
					t.Errorf("%d pixels of %v, want ≥ %d", n, c, tc.min)
				}
			}
			// The background is white.
			if r, g, b, _ := img.At(1, 1).RGBA(); r>>8 != 255 || g>>8 != 255 || b>>8 != 255 {
				t.Errorf("corner pixel %d %d %d", r>>8, g>>8, b>>8)
			}
		})
	}
}

// TestPNGVerticalLabel checks that the y label is drawn upright along the left edge: its ink
// spans more rows than columns.
func TestPNGVerticalLabel(t *testing.T) {
	c := &Chart{YLabel: "a rather long label on the y axis", Lines: []Line{{Points: []Point{{0, 0}, {1, 1}}, Color: Color(2)}}}
	img := readPNG(t, c, 400, 400)
	minX, maxX, minY, maxY := 400, 0, 400, 0
	for y := range 400 {
		for x := range int(math.Ceil(pad + labelSize*1.25)) {
			if r, _, _, _ := img.At(x, y).RGBA(); r>>8 < 128 {
				minX, maxX, minY, maxY = min(minX, x), max(maxX, x), min(minY, y), max(maxY, y)
			}
		}
	}
	if maxY-minY < 3*(maxX-minX) || maxY <= minY {
		t.Errorf("y label ink spans x %d..%d, y %d..%d", minX, maxX, minY, maxY)
	}
}

func TestDeterministic(t *testing.T) {
	for _, c := range []*Chart{lineChart(), barChart()} {
		var a, b bytes.Buffer
		if err := c.PNG(&a, 640, 400); err != nil {
			t.Fatal(err)
		}
		if err := c.PNG(&b, 640, 400); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a.Bytes(), b.Bytes()) {
			t.Error("two renderings differ")
		}
	}
}

func TestEdgeCases(t *testing.T) {
	cases := []struct {
		name  string
		chart *Chart
	}{
		{"empty", &Chart{}},
		{"one point", &Chart{Lines: []Line{{Label: "x", Points: []Point{{3, 3}}, Color: Color(0)}}}},
		{"flat line", &Chart{Lines: []Line{{Points: []Point{{0, 2}, {1, 2}}, Color: Color(0)}}}},
		{"not finite", &Chart{Lines: []Line{{Points: []Point{{math.NaN(), 1}, {1, math.Inf(1)}, {2, 3}, {3, 4}}, Color: Color(0)}}}},
		{"negative", &Chart{Lines: []Line{{Points: []Point{{-5, -0.25}, {5, 0.25}}, Color: Color(0), Dash: []float64{0, 2}}}}},
		{"bars without values", &Chart{Categories: []string{"a"}, Bars: []Bars{{Label: "m"}}}},
		{"bars out of range", &Chart{FixY: true, YMax: 1, Categories: []string{"a"}, Bars: []Bars{{Values: []float64{2, 3}}}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			readSVG(t, tc.chart, 300, 200)
			readPNG(t, tc.chart, 300, 200)
		})
	}
}

func TestSize(t *testing.T) {
	for _, wh := range [][2]int{{0, 100}, {119, 400}, {400, 9000}} {
		if err := lineChart().PNG(io.Discard, wh[0], wh[1]); !errors.Is(err, ErrSize) {
			t.Errorf("PNG %v: %v, want ErrSize", wh, err)
		}
		if err := lineChart().SVG(io.Discard, wh[0], wh[1]); !errors.Is(err, ErrSize) {
			t.Errorf("SVG %v: %v, want ErrSize", wh, err)
		}
	}
}

func TestNiceTicks(t *testing.T) {
	cases := []struct {
		name       string
		lo, hi     float64
		fixed      bool
		wantLo     float64
		wantHi     float64
		wantLabels []string
	}{
		{"unit fixed", 0, 1, true, 0, 1, []string{"0.0", "0.2", "0.4", "0.6", "0.8", "1.0"}},
		{"widened", 0.013, 0.9, false, 0, 1, []string{"0.0", "0.2", "0.4", "0.6", "0.8", "1.0"}},
		{"seconds", 0, 37, false, 0, 40, []string{"0", "10", "20", "30", "40"}},
		{"negative", -0.3, 0.3, false, -0.4, 0.4, []string{"-0.4", "-0.2", "0.0", "0.2", "0.4"}},
		{"negative fixed", -0.3, 0.3, true, -0.3, 0.3, []string{"-0.2", "0.0", "0.2"}},
		{"empty range", 2, 2, false, 1.4, 2.6, []string{"1.4", "1.6", "1.8", "2.0", "2.2", "2.4", "2.6"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			lo, hi, ticks, labels := niceTicks(tc.lo, tc.hi, 5, tc.fixed)
			if math.Abs(lo-tc.wantLo) > 1e-9 || math.Abs(hi-tc.wantHi) > 1e-9 {
				t.Errorf("range %v..%v, want %v..%v", lo, hi, tc.wantLo, tc.wantHi)
			}
			if !slices.Equal(labels, tc.wantLabels) || len(ticks) != len(labels) {
				t.Errorf("labels %q (%d ticks), want %q", labels, len(ticks), tc.wantLabels)
			}
		})
	}
}
