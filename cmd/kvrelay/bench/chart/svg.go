package chart

import (
	"bytes"
	"fmt"
	"image/color"
	"io"
	"strconv"
	"strings"
)

// SVG writes the chart as an SVG document of w×h pixels. Text is drawn in the viewer's
// sans-serif font, laid out with Go Regular's widths.
func (c *Chart) SVG(wr io.Writer, w, h int) error {
	if err := checkSize(w, h); err != nil {
		return err
	}
	m, err := newMeasurer()
	if err != nil {
		return err
	}
	s := &svgPainter{measurer: m}
	fmt.Fprintf(&s.b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="'Go', 'DejaVu Sans', Arial, sans-serif">`+"\n", w, h, w, h)
	c.draw(s, float64(w), float64(h))
	s.b.WriteString("</svg>\n")
	if _, err := wr.Write(s.b.Bytes()); err != nil {
		return fmt.Errorf("writing svg: %w", err)
	}
	return nil
}

type svgPainter struct {
	*measurer
	b     bytes.Buffer
	clips []rect // clip rectangles defined so far; clip path i is "c<i>"
}

func (s *svgPainter) num(v float64) {
	b := strconv.AppendFloat(s.b.AvailableBuffer(), v, 'f', 2, 64)
	b = bytes.TrimRight(b, "0")
	b = bytes.TrimSuffix(b, []byte("."))
	if len(b) == 0 || string(b) == "-" {
		b = append(b[:0], '0')
	}
	s.b.Write(b)
}

func (s *svgPainter) color(c color.RGBA) {
	fmt.Fprintf(&s.b, "#%02x%02x%02x", c.R, c.G, c.B)
}

func (s *svgPainter) fillRect(r rect, c color.RGBA) {
	s.b.WriteString(`<rect x="`)
	s.num(r.x0)
	s.b.WriteString(`" y="`)
	s.num(r.y0)
	s.b.WriteString(`" width="`)
	s.num(r.x1 - r.x0)
	s.b.WriteString(`" height="`)
	s.num(r.y1 - r.y0)
	s.b.WriteString(`" fill="`)
	s.color(c)
	s.b.WriteString("\"/>\n")
}

// clip returns the id of a clip path for r, defining it on first use; "" when r is not finite
// (no clipping).
func (s *svgPainter) clip(r rect) string {
	if !finite(r.x0) || !finite(r.y0) || !finite(r.x1) || !finite(r.y1) {
		return ""
	}
	for i, have := range s.clips {
		if have == r {
			return "c" + strconv.Itoa(i)
		}
	}
	id := "c" + strconv.Itoa(len(s.clips))
	s.clips = append(s.clips, r)
	s.b.WriteString(`<clipPath id="` + id + `"><rect x="`)
	s.num(r.x0)
	s.b.WriteString(`" y="`)
	s.num(r.y0)
	s.b.WriteString(`" width="`)
	s.num(r.x1 - r.x0)
	s.b.WriteString(`" height="`)
	s.num(r.y1 - r.y0)
	s.b.WriteString("\"/></clipPath>\n")
	return id
}

func (s *svgPainter) polyline(pts []Point, c color.RGBA, width float64, dash []float64, clip rect) {
	if len(pts) < 2 {
		return
	}
	id := s.clip(clip)
	s.b.WriteString(`<polyline fill="none" stroke-linejoin="round" stroke="`)
	s.color(c)
	s.b.WriteString(`" stroke-width="`)
	s.num(width)
	if len(dash) > 0 {
		s.b.WriteString(`" stroke-dasharray="`)
		for i, d := range dash {
			if i > 0 {
				s.b.WriteByte(' ')
			}
			s.num(d)
		}
	}
	if id != "" {
		s.b.WriteString(`" clip-path="url(#` + id + `)`)
	}
	s.b.WriteString(`" points="`)
	for i, p := range pts {
		if i > 0 {
			s.b.WriteByte(' ')
		}
		s.num(p.X)
		s.b.WriteByte(',')
		s.num(p.Y)
	}
	s.b.WriteString("\"/>\n")
}

var svgAnchor = [...]string{start: "start", middle: "middle", end: "end"}

var svgEscaper = strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;")

func (s *svgPainter) text(x, y float64, str string, size float64, a anchor, vertical bool, c color.RGBA) {
	s.b.WriteString(`<text x="`)
	s.num(x)
	s.b.WriteString(`" y="`)
	s.num(y)
	s.b.WriteString(`" font-size="`)
	s.num(size)
	s.b.WriteString(`" text-anchor="` + svgAnchor[a] + `" fill="`)
	s.color(c)
	if vertical {
		s.b.WriteString(`" transform="rotate(-90 `)
		s.num(x)
		s.b.WriteByte(' ')
		s.num(y)
		s.b.WriteByte(')')
	}
	s.b.WriteString(`">`)
	svgEscaper.WriteString(&s.b, str)
	s.b.WriteString("</text>\n")
}
