{{/* Labels of every object of this chart. */}}
{{- define "gpupool.labels" -}}
app.kubernetes.io/name: gpupool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* GPU-equivalents as a Kubernetes quantity in thousandths: 1.5 -> "1500m". */}}
{{- define "gpupool.milli" -}}
{{- printf "%dm" (int (round (mulf (float64 .) 1000) 0)) -}}
{{- end }}

{{/* The device-plugin resource of a MIG profile: 1g.10gb+me -> nvidia.com/mig-1g.10gb.me. */}}
{{- define "gpupool.migResource" -}}
{{- printf "nvidia.com/mig-%s" (replace "+me" ".me" .) -}}
{{- end }}

{{/* files/gpu-equivalents.yaml: model -> resource -> thousandths (generated from gpupool). */}}
{{- define "gpupool.table" -}}
{{- .Files.Get "files/gpu-equivalents.yaml" -}}
{{- end }}

{{/*
Checks across values that a JSON schema cannot express; each failure names the key to fix.
- every offer a team (or everyone) lists is defined in gpupool.offers;
- every MIG offer's profile exists on some GPU model gpupool knows.
*/}}
{{- define "gpupool.validate" -}}
{{- $offers := .Values.gpupool.offers -}}
{{- $teams := deepCopy .Values.gpupool.teams -}}
{{- $_ := set $teams "everyone" (.Values.gpupool.everyone | default dict) -}}
{{- range $team, $spec := $teams }}
{{- range $offer := ($spec.offers | default list) }}
{{- if not (hasKey $offers $offer) }}
{{- fail (printf "gpupool.teams.%s.offers: unknown offer %q; define it under gpupool.offers (defined: %s)" $team $offer (keys $offers | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}
{{- $table := include "gpupool.table" . | fromYaml -}}
{{- range $name, $spec := $offers }}
{{- $spec = $spec | default dict }}
{{- $kind := $spec.kind | default (ternary "cpu" (ternary "mig" "gpu" (hasPrefix "mig-" $name)) (eq $name "cpu")) }}
{{- if eq $kind "mig" }}
{{- $resource := include "gpupool.migResource" ($spec.profile | default (trimPrefix "mig-" $name)) }}
{{- $found := false }}
{{- range $model, $costs := $table }}
{{- if and (hasKey $costs $resource) (or (not $spec.model) (eq $spec.model $model)) }}{{ $found = true }}{{ end }}
{{- end }}
{{- if not $found }}
{{- fail (printf "gpupool.offers.%s: %s is not a MIG profile of %s; name the offer mig-<profile> with a profile like 3g.40gb, or set profile" $name ($spec.profile | default (trimPrefix "mig-" $name)) ($spec.model | default "any GPU model gpupool knows")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The LocalQueue (and ClusterQueue) name of a team: <release>-<team>. */}}
{{- define "gpupool.queueTemplate" -}}
{{- printf "%s-{team}" .Release.Name -}}
{{- end }}

{{/*
The teams Kueue gets a ClusterQueue for: every team, plus `everyone` when it has GPU quota.
A dict team -> spec.
*/}}
{{- define "gpupool.queueTeams" -}}
{{- $teams := deepCopy .Values.gpupool.teams -}}
{{- $everyone := .Values.gpupool.everyone | default dict -}}
{{- if or $everyone.guarantee $everyone.borrow_limit }}
{{- $_ := set $teams "everyone" $everyone -}}
{{- end }}
{{- toYaml $teams -}}
{{- end }}

{{/*
Kueue resource transformations: each GPU/MIG resource of the listed models -> GPU-equivalents.
Fails when two models price one resource differently (Kueue cannot tell them apart).
*/}}
{{- define "gpupool.transformations" -}}
{{- $table := include "gpupool.table" . | fromYaml -}}
{{- $merged := dict -}}
{{- $from := dict -}}
{{- range $model := .Values.kueue.gpuModels }}
{{- range $resource, $milli := (get $table $model) }}
{{- if and (hasKey $merged $resource) (ne (int (get $merged $resource)) (int $milli)) }}
{{- fail (printf "kueue.gpuModels: %s is %dm of a GPU on %s but %dm on %s; Kueue cannot tell them apart, so list models that agree (or run one gpupool per model)" $resource (int (get $merged $resource)) (get $from $resource) (int $milli) $model) }}
{{- end }}
{{- $_ := set $merged $resource $milli }}
{{- $_ := set $from $resource $model }}
{{- end }}
{{- end }}
{{- $out := list -}}
{{- range $resource := keys $merged | sortAlpha }}
{{- $out = append $out (dict "input" $resource "strategy" "Replace" "outputs" (dict $.Values.kueue.resource (printf "%dm" (int (get $merged $resource))))) }}
{{- end }}
{{- toYaml $out -}}
{{- end }}
