//go:build race

package oai

const raceEnabled = true
