package ledger

import (
	"fmt"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// BenchmarkLedgerAllocate is the ledger's share of one device plugin
// Allocate of one GPU on an 8-GPU node (issue 23: Allocate must stay fast):
// the check under the lock and, with a state directory, the allocation
// log's one write(2) of one JSON line. The log is never settled here, so
// it grows as the bench's allocations do.
//
//	go test -run '^$' -bench LedgerAllocate -benchmem ./ledger
func BenchmarkLedgerAllocate(b *testing.B) {
	var inventory []gpu.GPU
	var devs []Handout
	for i := range 8 {
		u := fmt.Sprintf("GPU-%08x-0000-0000-0000-%012x", i, i)
		devs = append(devs, Handout{UUID: u})
		inventory = append(inventory, gpu.GPU{UUID: u})
	}
	for _, bc := range []struct {
		name   string
		logged bool
	}{{"memory only", false}, {"with the log", true}} {
		b.Run(bc.name, func(b *testing.B) {
			dir := ""
			if bc.logged {
				dir = b.TempDir()
			}
			l, err := New(Options{StateDir: dir})
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			l.SetInventory(inventory)
			if bc.logged != (l.log != nil) {
				b.Fatalf("allocation log open: %v, want %v", l.log != nil, bc.logged)
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if err := l.Admit("nvidia.com/gpu", devs[i%len(devs):i%len(devs)+1]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}
