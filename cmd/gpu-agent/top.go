package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpu-agent/gpu-agent/telemetry"
)

// cmdTop is `gpu-agent top`: a running agent's holders (GET /holders) as a
// table, once, or again every --watch interval until interrupted.
func cmdTop(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("top", "top [--addr URL] [--watch DURATION] [--idle-only]", stderr)
	addr := fs.String("addr", envDefault("GPU_AGENT_ADDR", "http://127.0.0.1:9400"), "the agent's HTTP address [GPU_AGENT_ADDR]")
	watch := fs.Duration("watch", 0, "print the table again this often (0: once)")
	idleOnly := fs.Bool("idle-only", false, "only holders that have not used their device for a minute or more")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if *watch < 0 {
		return usageError{fmt.Sprintf("--watch %s: must not be negative", *watch)}
	}
	base := *addr
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	base = strings.TrimRight(base, "/")
	for {
		snap, err := fetchHolders(ctx, base)
		if err != nil {
			return err
		}
		if *watch > 0 {
			fmt.Fprint(stdout, "\033[H\033[2J") // the terminal's clear screen, as watch(1) does
		}
		if err := writeTop(stdout, snap, *idleOnly); err != nil {
			return err
		}
		if *watch == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(*watch):
		}
	}
}

func fetchHolders(ctx context.Context, base string) (*telemetry.HolderSnapshot, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/holders", nil)
	if err != nil {
		return nil, usageError{fmt.Sprintf("--addr %q: %v", base, err)}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("cannot reach the agent at %s: %w", base, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("read %s/holders: %w", base, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/holders: %s: %s (an agent older than gpu-agent top serves none)", base, resp.Status, strings.TrimSpace(string(body)))
	}
	var snap telemetry.HolderSnapshot
	if err := json.Unmarshal(body, &snap); err != nil {
		return nil, fmt.Errorf("%s/holders: not a gpu-agent answer: %w", base, err)
	}
	return &snap, nil
}

// writeTop renders the holders as kubectl top renders pods: one line each,
// by GPU and device.
func writeTop(w io.Writer, snap *telemetry.HolderSnapshot, idleOnly bool) error {
	var shown []telemetry.HolderUse
	for _, u := range snap.Holders {
		if !idleOnly || (u.UtilKnown && u.IdleSeconds >= 60) {
			shown = append(shown, u)
		}
	}
	mps := slices.ContainsFunc(shown, func(u telemetry.HolderUse) bool { return u.MPSThreadLimit > 0 })
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	header := "NAMESPACE\tPOD\tCONTAINER\tCLAIM\tGPU\tDEVICE\tSHARE\tSM%\tSM% 1H\tSM% 24H\tMEMORY\tPROCS\tIDLE FOR"
	if mps {
		header += "\tMPS LIMIT\tUSED OF LIMIT"
	}
	fmt.Fprintln(tw, header)
	for _, u := range shown {
		claim := "-"
		if u.Claim != nil {
			claim = u.Claim.Name
		}
		mem, procs := "-", "-"
		if u.Attributed {
			mem, procs = bytesIEC(u.FBBytes), strconv.Itoa(u.Processes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s", u.Namespace, u.Pod, u.Container, claim, u.GPU, heldDevice(u), holderShare(u),
			pct(u.SM, u.UtilKnown), avg(u.SMAvg, "1h"), avg(u.SMAvg, "24h"), mem, procs, idleFor(u))
		if mps {
			limit, used := mpsUse(u)
			fmt.Fprintf(tw, "\t%s\t%s", limit, used)
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case snap.Time.IsZero():
		_, err := fmt.Fprintln(w, "(the agent has not sampled its GPUs' processes yet)")
		return err
	case len(shown) == 0:
		_, err := fmt.Fprintln(w, "(no holders)")
		return err
	}
	return nil
}

// heldDevice is the device a holder holds on its GPU: the whole GPU or a
// MIG device.
func heldDevice(u telemetry.HolderUse) string {
	if u.MIGProfile == "" {
		return "whole"
	}
	return u.MIGProfile + " (GI " + strconv.Itoa(u.GI) + ")"
}

// holderShare is how many holders share the device, as a fraction.
func holderShare(u telemetry.HolderUse) string {
	if u.Sharers <= 1 {
		return "alone"
	}
	return "1/" + strconv.Itoa(u.Sharers)
}

// mpsUse is a holder's MPS active-thread limit and its SM % as a part of
// that limit ("-" for a holder that is no MPS client, or whose SM % is
// not known). The use is not capped: a client whose kernels run all the
// time reads over 100%.
func mpsUse(u telemetry.HolderUse) (limit, used string) {
	if u.MPSThreadLimit <= 0 {
		return "-", "-"
	}
	limit, used = strconv.Itoa(u.MPSThreadLimit)+"%", "-"
	if u.UtilKnown {
		used = pct(u.MPSLimitUsed, true) + "%"
	}
	return limit, used
}

func pct(v float64, known bool) string {
	if !known {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func avg(m map[string]float64, w string) string {
	v, ok := m[w]
	if !ok {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 1, 64)
}

// idleFor is how long the holder has not used its device, to the second
// under a minute and coarser above, as kubectl writes ages.
func idleFor(u telemetry.HolderUse) string {
	if !u.UtilKnown {
		return "-"
	}
	d := time.Duration(u.IdleSeconds) * time.Second
	switch {
	case d < 10*time.Second:
		return "active"
	case d < time.Hour:
		return d.Truncate(time.Second).String()
	case d < 48*time.Hour:
		return d.Truncate(time.Minute).String()
	}
	return strconv.Itoa(int(d.Hours()/24)) + "d"
}
