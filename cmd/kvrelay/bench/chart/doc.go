// Package chart draws the figures of a bench report, line charts and grouped bar charts, as
// SVG and PNG.
//
// It needs no plotting library. A report's figures are a few lines or bars, ticks, a grid, a
// legend and labels, while gonum/plot's init alone links twelve embedded fonts (4.4 MB) and
// PDF, EPS and TeX back ends into the binary that imports it, and kvrelay has one binary,
// the proxy's. SVG text names a font family and leaves the glyphs to the viewer; PNG
// text is set in Go Regular (golang.org/x/image/font/gofont/goregular, 130 KB), the one font
// embedded, which also measures text for the layout of both.
//
// A Chart is plain data: build it, then call SVG or PNG, from one goroutine at a time per
// Chart (rendering does not modify it). Rendering the same Chart gives the same bytes.
package chart
