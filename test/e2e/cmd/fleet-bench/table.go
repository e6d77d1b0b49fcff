package main

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// table writes the results as Markdown: one row per measured scenario (skipped and failed ones are listed
// below it, after notes), in the order they ran, and each row's binding rate against the whole-gpus-only row
// of the same fleet size and claim (the mean of its readings before and after the models), or of the same
// size's 1gpu claim for a claim whole GPUs cannot serve (a MIG profile): what the goal compares.
func table(rs []result, header, notes []string) string {
	var b strings.Builder
	for _, h := range header {
		fmt.Fprintf(&b, "%s\n", h)
	}
	if len(header) > 0 {
		b.WriteString("\n")
	}
	type rowKey struct {
		nodes int
		claim string
	}
	// baseline: the mean of the baseline's readings (before and after the models) per size and claim.
	sum, n := map[rowKey]float64{}, map[rowKey]int{}
	for _, r := range rs {
		if (r.Model == baselineModel || r.Model == baselineAgain) && r.Skip == "" && r.Err == "" && r.Bound > 0 {
			sum[rowKey{r.Nodes, r.Claim}] += r.Rate
			n[rowKey{r.Nodes, r.Claim}]++
		}
	}
	baseline := map[rowKey]float64{}
	for k, v := range sum {
		baseline[k] = v / float64(n[k])
	}
	b.WriteString("| model | N | claim | bound/asked | pods/s | vs whole-gpus-only | wall s | sched CPU s/pod | sched RSS peak MiB | sched live heap MiB | apiserver RSS peak MiB | sched ready s | slice kB/node | devices/node | counter sets × counters/node |\n")
	b.WriteString("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	notes = slices.Clone(notes)
	for _, r := range rs {
		switch {
		case r.Skip != "":
			notes = append(notes, fmt.Sprintf("- %s, %d nodes, %s: not measured: %s.", r.Model, r.Nodes, r.Claim, r.Skip))
			continue
		case r.Err != "":
			notes = append(notes, fmt.Sprintf("- %s, %d nodes, %s: failed: %s", r.Model, r.Nodes, r.Claim, r.Err))
			continue
		}
		rate := fmt.Sprintf("%.2f", r.Rate)
		if r.Bound < 2 {
			rate = "–"
		}
		if r.Rounds > 1 && r.RateMin != r.RateMax {
			rate += fmt.Sprintf(" (%.1f–%.1f)", r.RateMin, r.RateMax)
		}
		ratio := "–"
		base, ok := baseline[rowKey{r.Nodes, r.Claim}]
		against := ""
		if !ok {
			base, ok = baseline[rowKey{r.Nodes, "1gpu"}]
			against = " (1gpu)"
		}
		if ok && base > 0 && r.Bound >= 2 {
			ratio = fmt.Sprintf("%.3f%s", r.Rate/base, against)
		}
		bound := fmt.Sprintf("%d/%d", r.Bound, r.Asked)
		if r.TimedOut {
			bound += " (limit)"
			notes = append(notes, fmt.Sprintf("- %s, %d nodes, %s: %s.", r.Model, r.Nodes, r.Claim, strings.TrimRight(r.Why, ".")))
		}
		perPod := "–"
		if r.Bound > 0 {
			perPod = fmt.Sprintf("%.3f", r.SchedCPU.Seconds()/float64(r.Bound))
		}
		apiPeak := fmt.Sprint(r.API.HWM >> 20)
		if !r.APIPeakReset {
			apiPeak += " (since start)"
		}
		heap := "–"
		if r.SchedHeap > 0 {
			heap = fmt.Sprint(r.SchedHeap >> 20)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s | %.1f | %s | %d | %s | %s | %.1f | %.1f | %d | %s |\n",
			r.Model, r.Nodes, r.Claim, bound, rate, ratio, r.Wall.Seconds(), perPod, r.Sched.HWM>>20, heap, apiPeak,
			r.SchedStart.Seconds(), float64(r.SliceBytes)/1000, r.Stats.Devices, counters(r.Stats))
	}
	if len(notes) > 0 {
		b.WriteString("\n")
		b.WriteString(strings.Join(notes, "\n"))
		b.WriteString("\n")
	}
	return b.String()
}

// counters is "sets × counters each", or the totals when the sets differ in size.
func counters(s stats) string {
	switch {
	case s.CounterSets == 0:
		return "0"
	case s.Counters == s.CounterSets*s.MaxCounters:
		return fmt.Sprintf("%d × %d", s.CounterSets, s.MaxCounters)
	}
	return fmt.Sprintf("%d sets, %d counters", s.CounterSets, s.Counters)
}

// legend explains the columns under the table.
const legend = `Columns: *pods/s* is the steady binding rate (the pods bound after the last pod was created, over the
time from then to the last binding; from the first binding where fewer than 10 were left by then), the median
of the row's rounds, with the lowest and highest in brackets (each round creates the row's claims and pods again on the same scheduler, after the last round's are deleted; a round that reaches
the limit is the row's last); *vs whole-gpus-only* divides it by the whole-gpus-only rate of the same N and claim,
or of its 1gpu claim where whole GPUs cannot serve the claim ("(1gpu)"): the mean of the baseline's two readings,
before the models and after them (whole-gpus-only-again), whose own ratios show how far one reading strays; *wall s* runs from the first pod's
creation to the last binding, or to the time limit, and *sched CPU s/pod* is the scheduler's user+system CPU time
over that window divided by the pods bound, both in the median round; RSS peaks are VmHWM (the scheduler is
a fresh process per row, its peak over every round, and includes its initial list of the fleet; the API
server's peak is reset before the first round, to its RSS then, which holds the fleet); *sched live heap* is the
scheduler's HeapAlloc after the last round, read right after a garbage collection it is made to run (pprof's
heap?gc=1): what it holds, whenever its collector last ran (RSS also holds the garbage a collector lets grow
to the size of the live heap, and the runtime's and binary's own pages); *sched ready s* is from the scheduler's start
to its /readyz with the fleet already stored; slice bytes are one node's ResourceSlices as JSON, as the API server
returns them. With only a few pods bound, pods/s rests on a few bindings: bound/asked over the limit is the other
reading. whole-gpus-only is derived from the default model's slices (its type=gpu devices only, no
ConsumesCounters, no counter sets), not published by an agent; so is static-mig-nvidia-shape, from static-mig's
(its MIG devices without index and with a memorySlice<i> capacity per memory slice, as NVIDIA's DRA driver
publishes them).`

// duration formats a duration for the log.
func duration(d time.Duration) string { return d.Round(100 * time.Millisecond).String() }
