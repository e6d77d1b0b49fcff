package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/kube"
)

func cmdStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", "status [--addr URL] [-o table|json]", stderr)
	addr := fs.String("addr", envDefault("GPU_AGENT_ADDR", "http://127.0.0.1:9400"), "the agent's HTTP address [GPU_AGENT_ADDR]")
	out := fs.String("o", "table", "output: table or json")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if *out != "table" && *out != "json" {
		return usageError{fmt.Sprintf("-o %q: want table or json", *out)}
	}
	base := *addr
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/status", nil)
	if err != nil {
		return usageError{fmt.Sprintf("--addr %q: %v", *addr, err)}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the agent at %s: %w", base, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("read %s/status: %w", base, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s/status: %s: %s", base, resp.Status, strings.TrimSpace(string(body)))
	}
	if *out == "json" {
		_, err := stdout.Write(body)
		return err
	}
	var st agent.Status
	if err := json.Unmarshal(body, &st); err != nil {
		return fmt.Errorf("%s/status: not a gpu-agent status: %w", base, err)
	}
	return writeStatus(stdout, &st)
}

// writeStatus renders a status as readable tables.
func writeStatus(w io.Writer, st *agent.Status) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "Node:\t%s\n", st.Node)
	fmt.Fprintf(tw, "Backend:\t%s\n", st.Backend)
	cfg := st.Config.Name
	if st.Config.SelectedBy != "" {
		cfg += " (by " + st.Config.SelectedBy + ")"
	}
	fmt.Fprintf(tw, "Config:\t%s from %s, generation %d\n", cfg, st.Config.Source, st.Config.Generation)
	if st.Config.Error != "" {
		var kept string
		switch {
		case len(st.Resource) == 0:
			kept = "nothing served until a config applies"
		case st.Config.Serving == agent.BuiltInConfigName:
			kept = "serving the built-in default"
		case st.Config.Serving != "":
			kept = "serving " + st.Config.Serving + ", the last config that fitted"
		default:
			kept = "config " + st.Config.Name + " stays in force"
		}
		if !st.Config.ErrorSince.IsZero() {
			kept = "since " + st.Config.ErrorSince.Format(time.RFC3339) + "; " + kept
		}
		fmt.Fprintf(tw, "Config error:\t%s (%s)\n", st.Config.Error, kept)
	}
	for _, warn := range st.Config.Warnings {
		fmt.Fprintf(tw, "Config warning:\t%s\n", warn)
	}
	if !st.LastPass.IsZero() {
		fmt.Fprintf(tw, "Last reconcile:\t%s\n", st.LastPass.Format(time.RFC3339))
	}
	if s := st.State; s != nil {
		switch {
		case s.Error != "":
			fmt.Fprintf(tw, "State:\tNOT SAVED in %s since %s: %s\n", s.Dir, s.ErrorSince.Format(time.RFC3339), s.Error)
		case !s.CheckpointWritten.IsZero():
			fmt.Fprintf(tw, "State:\t%s, checkpoint written %s\n", s.Dir, s.CheckpointWritten.Format(time.RFC3339))
		default:
			fmt.Fprintf(tw, "State:\t%s\n", s.Dir)
		}
	}
	fmt.Fprintln(tw)

	fmt.Fprintln(tw, "GPU\tNAME\tUUID\tMEMORY\tNUMA\tMIG")
	for _, g := range st.GPUs {
		mig := "-"
		if g.MIGCapable {
			mig = onOff(g.MIG.Current)
			if g.MIG.Pending != g.MIG.Current {
				mig += " (pending " + onOff(g.MIG.Pending) + ")"
			}
			if n := len(g.Instances); n > 0 {
				mig += fmt.Sprintf(", %d instances", n)
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.0f GiB\t%s\t%s\n", g.Index, g.Name, g.UUID,
			float64(g.MemoryBytes)/(1<<30), numa(g.NUMANode), mig)
	}
	for _, e := range st.Errors {
		fmt.Fprintf(tw, "!\t%s\n", e)
	}
	for _, u := range st.Unread {
		forget := "kept until NVML reads it again"
		if !u.ForgetAt.IsZero() {
			forget = "forgotten at " + u.ForgetAt.Format(time.RFC3339) + " unless NVML lists it again"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\tunreadable since %s: %s; %s\n", u.Index, u.Name, u.UUID, u.Since.Format(time.RFC3339), u.Reason, forget)
	}
	if c := st.Cordon; c != nil {
		for _, g := range c.GPUs {
			fmt.Fprintf(tw, "%d\t\t%s\tCORDONED (%s lists %s): offered to no new work; holders keep it\n", g.Index, g.UUID, kube.CordonAnnotation, g.As)
		}
		if len(c.Unknown) > 0 {
			fmt.Fprintf(tw, "!\t%s names no GPU of this node, ignored: %s\n", kube.CordonAnnotation, strings.Join(c.Unknown, ", "))
		}
	}
	fmt.Fprintln(tw)

	if len(st.Sharing) > 0 {
		fmt.Fprintln(tw, "SHARED DEVICE\tGPU\tRESOURCE\tMODE\tREPLICAS\tLIMITS\tHELD")
		for _, sh := range st.Sharing {
			limits := "-"
			if sh.Mode == "mps" {
				limits = fmt.Sprintf("threads %s%%, memory %s", sh.ActiveThreadPercentage, sh.PinnedMemoryLimit)
			}
			held := "-"
			if len(sh.Holders) > 0 {
				held = strings.Join(sh.Holders, "; ")
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%s\t%s\n", sh.Device, sh.GPU, sh.Resource, sh.Mode, sh.Replicas, limits, held)
		}
		fmt.Fprintln(tw)
	}

	if len(st.MIG) > 0 {
		fmt.Fprintln(tw, "GPU\tMIG WANT\tSTATE\tREASON")
		for _, m := range st.MIG {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", m.GPU, m.Want, m.Phase, m.Reason)
		}
		fmt.Fprintln(tw)
	}

	reg := map[string]agent.Registration{}
	for _, r := range st.Registrations {
		reg[r.Resource] = r
	}
	fmt.Fprintln(tw, "RESOURCE\tDEVICES\tHEALTHY\tKUBELET")
	for _, r := range st.Resource {
		healthy := 0
		for _, d := range r.Devices {
			if d.Healthy {
				healthy++
			}
		}
		state := "not registered"
		if rr, ok := reg[r.Name]; ok {
			if rr.Registered {
				state = "registered " + rr.RegisteredAt.Format(time.RFC3339)
			} else if rr.LastError != "" {
				state = "not registered: " + rr.LastError
			}
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", r.Name, len(r.Devices), healthy, state)
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "RESOURCE\tDEVICE\tGPU\tNUMA\tHELD BY\tHEALTH")
	for _, r := range st.Resource {
		for _, d := range r.Devices {
			h := "healthy"
			if !d.Healthy {
				h = "unhealthy"
				if d.Reason != "" {
					h += ": " + d.Reason
				}
			}
			held := d.HeldBy
			if held == "" {
				held = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", r.Name, d.ID, d.GPU, numa(d.NUMANode), held, h)
		}
	}
	return tw.Flush()
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

func numa(n int) string {
	if n < 0 {
		return "-"
	}
	return fmt.Sprint(n)
}
