package imex

import (
	"fmt"
	"testing"
)

// Each domain gets a channel of its own, the same on every node where it
// is free, never channel 0 while others are free; a full node refuses.
func TestAssignChannel(t *testing.T) {
	held := map[int]string{}
	seen := map[int]bool{}
	for i := range 7 {
		d := fmt.Sprintf("domain-%d", i)
		ch, err := assignChannel(d, 8, held)
		if err != nil {
			t.Fatal(err)
		}
		if seen[ch] || ch == 0 {
			t.Fatalf("%s got channel %d (held %v)", d, ch, held)
		}
		again, _ := assignChannel(d, 8, map[int]string{})
		if held[again] == "" && again != ch {
			t.Errorf("%s: channel %d here, %d on an empty node", d, ch, again)
		}
		seen[ch], held[ch] = true, d
		if got, _ := assignChannel(d, 8, held); got != ch {
			t.Errorf("%s asked again: %d, want its own %d", d, got, ch)
		}
	}
	if ch, err := assignChannel("domain-7", 8, held); err != nil || ch != 0 {
		t.Errorf("eighth domain: %d %v, want channel 0 last", ch, err)
	}
	held[0] = "domain-7"
	if _, err := assignChannel("domain-8", 8, held); err == nil {
		t.Error("a ninth domain on 8 channels was given one")
	}
	if _, err := assignChannel("d", 0, nil); err == nil {
		t.Error("a channel given with ImexChannelCount 0")
	}
	if ch, err := assignChannel("d", 1, nil); err != nil || ch != 0 {
		t.Errorf("one channel: %d %v", ch, err)
	}
}
